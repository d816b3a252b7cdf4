// kvret-session-sim: replays synthetic multi-turn conversations against the session placement policies
// (scheduler-aware, LRU, FIFO) at given DRAM and disk capacities, and reports hit rates per tier and the prefill
// saved. The model and its parameters: src/session/trace_sim.hpp and docs/sessions.md.
#include "session/trace_sim.hpp"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace kvret::session;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

void usage() {
  std::printf(
      "usage: kvret-session-sim [options]\n"
      "  --dram-gib X          host DRAM capacity (default 32)\n"
      "  --disk-gib X          disk capacity (default 128)\n"
      "  --sweep A,B,...       DRAM capacities in GiB to sweep (instead of --dram-gib)\n"
      "  --policy P            all | scheduler-aware | lru | fifo (default all)\n"
      "  --lookahead N         jobs the scheduler knows ahead (default 256)\n"
      "  --mean-session-gib X  fix S_kv of the window rule (default: mean of the held sessions)\n"
      "  --conversations N     (default 2000)\n"
      "  --rate R              conversation arrivals per second, Poisson (default 0.5)\n"
      "  --turns X             mean turns per conversation, geometric (default 5.75)\n"
      "  --think-s X           mean time between two turns' arrivals (default 120)\n"
      "  --think-sigma S       0: exponential think times (default); > 0: lognormal with this sigma\n"
      "  --prompt-mean X --prompt-sigma S   lognormal prompt tokens (default 161, 1.0)\n"
      "  --answer-mean X --answer-sigma S   lognormal answer tokens (default 338, 0.8)\n"
      "  --max-message N       clip of one prompt or answer (default 4096)\n"
      "  --max-context N       KV tokens kept per session (default 8192)\n"
      "  --layers N --kv-heads N --head-dim N --dtype-bytes N   KV bytes per token (default 32, 8, 128, 2)\n"
      "  --prefill-tps X       prefill tokens per second, for the time saved (default 10000)\n"
      "  --disk-gbps X         disk read GB/s for prefetching (default 5; 0: unlimited)\n"
      "  --seed N              (default 1)\n"
      "  --csv                 CSV rows instead of the table\n");
}

std::vector<double> parse_list(const std::string& text) {
  std::vector<double> values;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!item.empty()) values.push_back(std::stod(item));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return values;
}

std::uint64_t gib_bytes(double gib) { return static_cast<std::uint64_t>(gib * kGiB); }

double pct(std::uint64_t part, std::uint64_t whole) {
  return whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole);
}

int run(int argc, char** argv) {
  ConversationModel model;
  SimConfig sim;
  double dram_gib = 32;
  double disk_gib = 128;
  double mean_session_gib = 0;
  std::vector<double> sweep;
  std::string policy = "all";
  bool csv = false;
  std::uint64_t layers = 32, kv_heads = 8, head_dim = 128, dtype_bytes = 2;

  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + std::string(arg));
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      usage();
      return 0;
    } else if (arg == "--dram-gib") {
      dram_gib = std::stod(value());
    } else if (arg == "--disk-gib") {
      disk_gib = std::stod(value());
    } else if (arg == "--sweep") {
      sweep = parse_list(value());
    } else if (arg == "--policy") {
      policy = value();
    } else if (arg == "--lookahead") {
      sim.lookahead = std::stoull(value());
    } else if (arg == "--mean-session-gib") {
      mean_session_gib = std::stod(value());
    } else if (arg == "--conversations") {
      model.conversations = std::stoull(value());
    } else if (arg == "--rate") {
      model.arrival_rate = std::stod(value());
    } else if (arg == "--turns") {
      model.mean_turns = std::stod(value());
    } else if (arg == "--think-s") {
      model.mean_think_s = std::stod(value());
    } else if (arg == "--think-sigma") {
      model.think_sigma = std::stod(value());
    } else if (arg == "--prompt-mean") {
      model.prompt_mean = std::stod(value());
    } else if (arg == "--prompt-sigma") {
      model.prompt_sigma = std::stod(value());
    } else if (arg == "--answer-mean") {
      model.answer_mean = std::stod(value());
    } else if (arg == "--answer-sigma") {
      model.answer_sigma = std::stod(value());
    } else if (arg == "--max-message") {
      model.max_message_tokens = static_cast<std::uint32_t>(std::stoul(value()));
    } else if (arg == "--max-context") {
      model.max_context = static_cast<std::uint32_t>(std::stoul(value()));
    } else if (arg == "--layers") {
      layers = std::stoull(value());
    } else if (arg == "--kv-heads") {
      kv_heads = std::stoull(value());
    } else if (arg == "--head-dim") {
      head_dim = std::stoull(value());
    } else if (arg == "--dtype-bytes") {
      dtype_bytes = std::stoull(value());
    } else if (arg == "--prefill-tps") {
      sim.prefill_tokens_per_s = std::stod(value());
    } else if (arg == "--disk-gbps") {
      sim.disk_read_bytes_per_s = std::stod(value()) * 1e9;
    } else if (arg == "--seed") {
      model.seed = std::stoull(value());
    } else if (arg == "--csv") {
      csv = true;
    } else {
      usage();
      throw std::invalid_argument("unknown option " + std::string(arg));
    }
  }
  sim.kv_bytes_per_token = layers * kv_heads * head_dim * 2 * dtype_bytes;
  sim.max_session_tokens = model.max_context;
  sim.placement.mean_session_bytes = gib_bytes(mean_session_gib);
  if (sweep.empty()) sweep.push_back(dram_gib);

  std::vector<Policy> policies;
  if (policy == "all" || policy == "scheduler-aware") policies.push_back(Policy::scheduler_aware);
  if (policy == "all" || policy == "lru") policies.push_back(Policy::lru);
  if (policy == "all" || policy == "fifo") policies.push_back(Policy::fifo);
  if (policies.empty()) throw std::invalid_argument("unknown policy " + policy);

  const Trace trace = generate_trace(model);
  std::uint64_t turns = 0;
  for (const std::uint32_t t : trace.turns) turns += t;
  std::uint64_t kept_tokens = 0;
  for (const Job& job : trace.jobs) kept_tokens += job.kept;
  const double mean_session =
      trace.jobs.empty() ? 0.0 : static_cast<double>(kept_tokens) / static_cast<double>(trace.jobs.size());

  if (csv) {
    std::printf(
        "policy,dram_gib,disk_gib,jobs,returning,dram_hit_pct,disk_hit_pct,miss_pct,prefill_tokens,"
        "prefill_tokens_saved,prefill_saved_pct,prefill_s_saved,prefetched_gib,demoted_gib\n");
  } else {
    std::printf(
        "trace: %llu conversations, %zu jobs, %.3f turns per conversation, mean session after a turn %.0f tokens "
        "(%.1f MiB at %llu B/token), lookahead %zu jobs, seed %llu\n",
        static_cast<unsigned long long>(model.conversations), trace.jobs.size(),
        trace.turns.empty() ? 0.0 : static_cast<double>(turns) / static_cast<double>(trace.turns.size()), mean_session,
        mean_session * static_cast<double>(sim.kv_bytes_per_token) / (1024.0 * 1024.0),
        static_cast<unsigned long long>(sim.kv_bytes_per_token), sim.lookahead,
        static_cast<unsigned long long>(model.seed));
    std::printf("%-16s %9s %9s %9s %9s %9s %9s %13s %9s\n", "policy", "dram GiB", "disk GiB", "returning", "dram %",
                "disk %", "miss %", "prefill saved", "saved s");
  }
  for (const double gib : sweep) {
    for (const Policy p : policies) {
      SimConfig config = sim;
      config.placement.policy = p;
      config.placement.dram_bytes = gib_bytes(gib);
      config.placement.disk_bytes = gib_bytes(disk_gib);
      const SimResult r = simulate(trace, config);
      const double saved_pct = pct(r.prefill_tokens_saved, r.prefill_tokens);
      if (csv) {
        std::printf("%s,%g,%g,%llu,%llu,%.2f,%.2f,%.2f,%llu,%llu,%.2f,%.1f,%.1f,%.1f\n", to_string(p).data(), gib,
                    disk_gib, static_cast<unsigned long long>(r.jobs), static_cast<unsigned long long>(r.returning),
                    pct(r.dram_hits, r.returning), pct(r.disk_hits, r.returning), pct(r.misses, r.returning),
                    static_cast<unsigned long long>(r.prefill_tokens),
                    static_cast<unsigned long long>(r.prefill_tokens_saved), saved_pct, r.prefill_s_saved,
                    static_cast<double>(r.prefetched_bytes) / kGiB, static_cast<double>(r.demoted_bytes) / kGiB);
      } else {
        std::printf("%-16s %9g %9g %9llu %9.1f %9.1f %9.1f %12.1f%% %9.0f\n", to_string(p).data(), gib, disk_gib,
                    static_cast<unsigned long long>(r.returning), pct(r.dram_hits, r.returning),
                    pct(r.disk_hits, r.returning), pct(r.misses, r.returning), saved_pct, r.prefill_s_saved);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvret-session-sim: %s\n", e.what());
    return 2;
  }
}
