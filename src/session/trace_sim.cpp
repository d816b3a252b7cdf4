#include "session/trace_sim.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <stdexcept>
#include <tuple>

namespace kvret::session {

namespace {

// Numbers from the raw 64-bit stream, by fixed formulas.
class Draw {
 public:
  explicit Draw(std::uint64_t seed) : rng_(seed) {}
  // Uniform in (0, 1): 53 random bits, never 0.
  double uniform() { return (static_cast<double>(rng_() >> 11) + 0.5) * 0x1.0p-53; }
  double exponential(double mean) { return -std::log(uniform()) * mean; }
  // Geometric on {1, 2, ...} with the given mean (>= 1): inversion, 1 + floor(ln u / ln(1 - p)).
  std::uint32_t geometric(double mean) {
    if (mean <= 1.0) return 1;
    const double p = 1.0 / mean;
    const double k = std::floor(std::log(uniform()) / std::log1p(-p));
    return 1 + static_cast<std::uint32_t>(std::min(k, 1e6));
  }
  double normal() {  // Box-Muller, one of the pair
    const double u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
  // Lognormal with the given mean and log-space sigma: mu = ln(mean) - sigma^2 / 2.
  double lognormal(double mean, double sigma) {
    return std::exp(std::log(mean) - 0.5 * sigma * sigma + sigma * normal());
  }

 private:
  std::mt19937_64 rng_;
};

std::uint32_t tokens(Draw& draw, double mean, double sigma, std::uint32_t cap) {
  const double x = std::round(draw.lognormal(mean, sigma));
  return static_cast<std::uint32_t>(std::clamp(x, 1.0, static_cast<double>(cap)));
}

}  // namespace

Trace generate_trace(const ConversationModel& model) {
  if (!(model.arrival_rate > 0) || !(model.mean_turns >= 1) || !(model.mean_think_s > 0) || !(model.think_sigma >= 0) ||
      !(model.prompt_mean > 0) || !(model.answer_mean > 0) || !(model.prompt_sigma >= 0) ||
      !(model.answer_sigma >= 0) || model.max_message_tokens == 0 || model.max_context == 0) {
    throw std::invalid_argument("generate_trace: a model parameter is out of range");
  }
  Draw draw(model.seed);
  Trace trace;
  trace.turns.reserve(model.conversations);
  double start = 0;
  for (std::uint64_t c = 0; c < model.conversations; ++c) {
    start += draw.exponential(1.0 / model.arrival_rate);
    const std::uint32_t turns = draw.geometric(model.mean_turns);
    trace.turns.push_back(turns);
    double time = start;
    std::uint32_t history = 0;
    for (std::uint32_t t = 1; t <= turns; ++t) {
      if (t > 1) {
        time += model.think_sigma > 0 ? draw.lognormal(model.mean_think_s, model.think_sigma)
                                      : draw.exponential(model.mean_think_s);
      }
      Job job;
      job.time = time;
      job.session = c;
      job.turn = t;
      job.history = history;
      job.prompt = tokens(draw, model.prompt_mean, model.prompt_sigma, model.max_message_tokens);
      job.answer = tokens(draw, model.answer_mean, model.answer_sigma, model.max_message_tokens);
      job.last = t == turns;
      const std::uint64_t grown = std::uint64_t{history} + job.prompt + job.answer;
      history = static_cast<std::uint32_t>(std::min<std::uint64_t>(grown, model.max_context));
      job.kept = history;
      trace.jobs.push_back(job);
    }
  }
  std::sort(trace.jobs.begin(), trace.jobs.end(), [](const Job& a, const Job& b) {
    return std::tie(a.time, a.session, a.turn) < std::tie(b.time, b.session, b.turn);
  });
  return trace;
}

SimResult simulate(const Trace& trace, const SimConfig& config) {
  Placement placement(config.placement);
  std::vector<SessionId> order;
  order.reserve(trace.jobs.size());
  for (const Job& job : trace.jobs) order.push_back(job.session);

  SimResult result;
  double credit = 0;  // bytes the disk may still read for prefetching
  for (std::size_t i = 0; i < trace.jobs.size(); ++i) {
    const Job& job = trace.jobs[i];
    const std::size_t begin = i + 1;
    const std::size_t end = std::min(order.size(), begin + config.lookahead);
    const std::span<const SessionId> queue(order.data() + begin, end - begin);
    ++result.jobs;
    result.prefill_tokens += std::uint64_t{job.history} + job.prompt;
    if (job.turn > 1) {
      ++result.returning;
      switch (placement.access(job.session)) {
        case Tier::dram:
          ++result.dram_hits;
          result.prefill_tokens_saved += job.history;
          break;
        case Tier::disk:
          ++result.disk_hits;
          result.prefill_tokens_saved += job.history;
          break;
        case Tier::miss:
          ++result.misses;
          break;
      }
    }
    placement.save(job.session, std::uint64_t{job.kept} * config.kv_bytes_per_token, queue);
    if (config.disk_read_bytes_per_s > 0) {
      const double gap = i + 1 < trace.jobs.size() ? trace.jobs[i + 1].time - job.time : 0.0;
      const double cap = static_cast<double>(config.max_session_tokens * config.kv_bytes_per_token);
      credit = std::min(credit + config.disk_read_bytes_per_s * gap, std::max(cap, config.disk_read_bytes_per_s * gap));
      credit -= static_cast<double>(placement.prefetch(queue, static_cast<std::uint64_t>(credit)));
    } else {
      placement.prefetch(queue);
    }
    result.peak_dram_bytes = std::max(result.peak_dram_bytes, placement.used(Tier::dram));
    result.peak_disk_bytes = std::max(result.peak_disk_bytes, placement.used(Tier::disk));
  }
  result.prefill_s_saved = config.prefill_tokens_per_s > 0
                               ? static_cast<double>(result.prefill_tokens_saved) / config.prefill_tokens_per_s
                               : 0;
  result.prefetched_bytes = placement.stats().prefetched_bytes;
  result.demoted_bytes = placement.stats().demoted_bytes;
  result.not_saved = placement.stats().not_saved;
  return result;
}

}  // namespace kvret::session
