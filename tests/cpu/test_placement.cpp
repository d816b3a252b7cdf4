// Session placement across DRAM and disk (src/session/placement) and the trace simulator (src/session/trace_sim).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <unordered_map>
#include <vector>

#include "session/placement.hpp"
#include "session/trace_sim.hpp"

namespace {

using namespace kvret::session;
using Ids = std::vector<SessionId>;

Placement make(Policy policy, std::uint64_t dram, std::uint64_t disk, std::uint64_t mean = 0) {
  PlacementConfig config;
  config.policy = policy;
  config.dram_bytes = dram;
  config.disk_bytes = disk;
  config.mean_session_bytes = mean;
  return Placement(config);
}

// The generic invariants: capacities hold, a session is in one tier, whole, with the bytes of its last save.
void check_invariants(const Placement& p, const std::unordered_map<SessionId, std::uint64_t>& last_saved) {
  for (const Tier tier : {Tier::dram, Tier::disk}) {
    ASSERT_LE(p.used(tier), p.capacity(tier)) << to_string(tier);
    std::uint64_t sum = 0;
    for (const SessionId id : p.sessions(tier)) {
      ASSERT_EQ(p.where(id), tier);
      const auto it = last_saved.find(id);
      ASSERT_NE(it, last_saved.end());
      ASSERT_EQ(p.bytes_of(id), it->second);  // all or nothing: never a part of it
      sum += p.bytes_of(id);
    }
    ASSERT_EQ(sum, p.used(tier));
  }
  const Ids dram = p.sessions(Tier::dram);
  for (const SessionId id : p.sessions(Tier::disk)) {
    ASSERT_FALSE(std::binary_search(dram.begin(), dram.end(), id));
  }
}

TEST(Placement, AllOrNothing) {
  for (const Policy policy : {Policy::scheduler_aware, Policy::lru, Policy::fifo}) {
    Placement p = make(policy, 100, 200);
    EXPECT_EQ(p.access(1), Tier::miss);         // unknown: the prefill is recomputed
    EXPECT_EQ(p.save(1, 300, {}), Tier::miss);  // fits neither tier: not stored at all
    EXPECT_EQ(p.where(1), Tier::miss);
    EXPECT_EQ(p.used(Tier::dram) + p.used(Tier::disk), 0u);
    EXPECT_EQ(p.save(2, 150, {}), Tier::disk);  // larger than DRAM: straight to disk, whole
    EXPECT_EQ(p.bytes_of(2), 150u);
    EXPECT_EQ(p.save(3, 100, {}), Tier::dram);  // exactly DRAM's capacity
    EXPECT_EQ(p.used(Tier::dram), 100u);
    EXPECT_EQ(p.access(3), Tier::dram);
    EXPECT_EQ(p.access(2), Tier::disk);
    // Session 3 grows past DRAM: the old copy is replaced, the new one goes to disk (evicting 2 to make room).
    EXPECT_EQ(p.save(3, 120, {}), Tier::disk);
    EXPECT_EQ(p.used(Tier::dram), 0u);
    EXPECT_EQ(p.bytes_of(3), 120u);
    EXPECT_EQ(p.where(2), Tier::miss);
    EXPECT_TRUE(p.drop(3));
    EXPECT_FALSE(p.drop(3));
    EXPECT_EQ(p.used(Tier::disk), 0u);
  }
}

TEST(Placement, DemotionMovesTheVictimToDiskAndDiskEvictionDropsIt) {
  Placement p = make(Policy::lru, 200, 100);
  p.save(1, 100, {});
  p.save(2, 100, {});
  p.save(3, 100, {});  // 1 (least recent) goes down to disk
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{2, 3}));
  EXPECT_EQ(p.sessions(Tier::disk), (Ids{1}));
  p.save(4, 100, {});  // 2 goes down, 1 is dropped from disk
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{3, 4}));
  EXPECT_EQ(p.sessions(Tier::disk), (Ids{2}));
  EXPECT_EQ(p.where(1), Tier::miss);
  EXPECT_EQ(p.stats().dropped, 1u);
  EXPECT_EQ(p.stats().demoted_bytes, 200u);
}

TEST(Placement, LruEvictsTheLeastRecentlyUsed) {
  Placement p = make(Policy::lru, 300, 1000);
  p.save(1, 100, {});
  p.save(2, 100, {});
  p.save(3, 100, {});
  p.access(1);         // 1 becomes the most recent: 2 is now the least
  p.save(4, 100, {});  // evicts 2
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 3, 4}));
  EXPECT_EQ(p.where(2), Tier::disk);
  p.access(3);
  p.save(5, 100, {});  // uses: 1 (access), 4 (save), 3 (access): evicts 1
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{3, 4, 5}));
  p.save(3, 100, {});  // a re-save is a use
  p.save(6, 100, {});  // evicts 4
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{3, 5, 6}));
  EXPECT_EQ(p.sessions(Tier::disk), (Ids{1, 2, 4}));
}

TEST(Placement, FifoEvictsTheEarliestToEnter) {
  Placement p = make(Policy::fifo, 300, 1000);
  p.save(1, 100, {});
  p.save(2, 100, {});
  p.save(3, 100, {});
  p.access(1);         // an access does not change the order
  p.save(1, 100, {});  // nor does a re-save of a session that stays in DRAM
  p.save(4, 100, {});  // evicts 1, the first in
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{2, 3, 4}));
  EXPECT_EQ(p.where(1), Tier::disk);
  p.save(1, 100, {});  // 1 comes back from disk: it enters DRAM again, last; 2 goes
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 3, 4}));
  p.save(5, 100, {});  // evicts 3
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 4, 5}));
  EXPECT_EQ(p.sessions(Tier::disk), (Ids{2, 3}));
}

TEST(Placement, SchedulerAwareEvictsTheSessionNeededFurthest) {
  Placement p = make(Policy::scheduler_aware, 300, 1000);
  p.save(1, 100, {});
  p.save(2, 100, {});
  p.save(3, 100, {});
  // Queue: 2, 4, 1, 3: of the DRAM sessions, 3 is needed furthest (LRU would take 1).
  p.save(4, 100, Ids{2, 4, 1, 3});
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 2, 4}));
  EXPECT_EQ(p.where(3), Tier::disk);
  // A session in no queue position is needed never: it goes before every queued one, even the most recent.
  p.access(2);
  p.save(5, 100, Ids{4, 1, 5});
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 4, 5}));
  // The saved session itself needed furthest: it goes to disk and evicts nothing.
  p.save(6, 100, Ids{1, 4, 5, 6});
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 4, 5}));
  EXPECT_EQ(p.where(6), Tier::disk);
  // From disk too: the one needed furthest or never goes first.
  Placement q = make(Policy::scheduler_aware, 0, 300);
  q.save(1, 100, {});
  q.save(2, 100, {});
  q.save(3, 100, {});
  q.save(4, 100, Ids{3, 4, 1});  // 2: never needed
  EXPECT_EQ(q.sessions(Tier::disk), (Ids{1, 3, 4}));
  q.save(5, 100, Ids{5, 3, 4, 1});  // 1: furthest
  EXPECT_EQ(q.sessions(Tier::disk), (Ids{3, 4, 5}));
}

TEST(Placement, SchedulerAwareSparesTheWindowWhileAnotherCandidateExists) {
  // W = C_mem / S_kv = 350 / 87 = 4 sessions.
  Placement p = make(Policy::scheduler_aware, 350, 1000, 87);
  EXPECT_EQ(p.window_sessions(), 4u);
  p.save(1, 100, {});
  p.save(2, 100, {});
  p.save(3, 100, {});
  p.save(9, 50, {});  // outside the window below, the smallest and the most recent
  // Window {1, 7, 2, 3}. 9 frees too little but goes first; then 3, the furthest inside the window and needed after 7.
  const Ids queue{1, 7, 2, 3, 9};
  p.save(7, 100, queue);
  EXPECT_EQ(p.where(9), Tier::disk);
  EXPECT_EQ(p.where(3), Tier::disk);
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 2, 7}));
  EXPECT_EQ(p.used(Tier::dram), 300u);
  p.save(8, 50, Ids{1, 2, 7, 3, 8});  // DRAM has room: nothing moves
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 2, 7, 8}));
}

TEST(Placement, PrefetchBringsTheWindowIntoDram) {
  Placement p = make(Policy::scheduler_aware, 300, 1000, 100);  // W = 3
  for (SessionId id = 1; id <= 6; ++id) p.save(id, 100, {});    // no queue: the least recent go down
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{4, 5, 6}));
  EXPECT_EQ(p.sessions(Tier::disk), (Ids{1, 2, 3}));
  const Ids queue{1, 4, 1, 2, 3, 5};  // window: the first 3 distinct sessions, {1, 4, 2}
  EXPECT_EQ(p.prefetch(queue), 200u);
  EXPECT_EQ(p.sessions(Tier::dram), (Ids{1, 2, 4}));
  EXPECT_EQ(p.sessions(Tier::disk), (Ids{3, 5, 6}));
  EXPECT_EQ(p.access(1), Tier::dram);
  EXPECT_EQ(p.stats().prefetched_bytes, 200u);
  EXPECT_EQ(p.prefetch(queue), 0u);  // already there
  // A prefetch evicts only sessions needed later than the one it brings: with the window all in DRAM and 3 needed
  // after them, 3 stays on disk even with W raised.
  Placement q = make(Policy::scheduler_aware, 300, 1000, 75);  // W = 4
  for (SessionId id = 1; id <= 4; ++id) q.save(id, 100, {});
  EXPECT_EQ(q.sessions(Tier::disk), (Ids{1}));
  EXPECT_EQ(q.prefetch(Ids{2, 3, 4, 1}), 0u);
  EXPECT_EQ(q.where(1), Tier::disk);
  // The byte budget: whole sessions, in queue order, stopping at the first that does not fit in it.
  Placement r = make(Policy::scheduler_aware, 300, 1000, 100);
  for (SessionId id = 1; id <= 6; ++id) r.save(id, 100, {});
  EXPECT_EQ(r.prefetch(Ids{1, 2, 3}, 150), 100u);
  EXPECT_EQ(r.where(1), Tier::dram);
  EXPECT_EQ(r.where(2), Tier::disk);
  // LRU and FIFO do not prefetch.
  for (const Policy policy : {Policy::lru, Policy::fifo}) {
    Placement s = make(policy, 300, 1000, 100);
    for (SessionId id = 1; id <= 6; ++id) s.save(id, 100, {});
    EXPECT_EQ(s.prefetch(Ids{1, 2, 3}), 0u);
    EXPECT_EQ(s.where(1), Tier::disk);
  }
}

// Random operations on every policy: the invariants after each, and the window rule on every scheduler-aware save.
TEST(Placement, RandomOperationsKeepTheInvariants) {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    for (const Policy policy : {Policy::scheduler_aware, Policy::lru, Policy::fifo}) {
      std::mt19937_64 rng(seed);
      auto pick = [&](std::uint64_t n) { return static_cast<std::uint64_t>(rng() % n); };
      const std::uint64_t dram = 200 + pick(800);
      const std::uint64_t disk = pick(2000);
      Placement p = make(policy, dram, disk, seed % 2 == 0 ? 0 : 50 + pick(100));
      std::unordered_map<SessionId, std::uint64_t> last_saved;
      for (int op = 0; op < 400; ++op) {
        Ids queue(pick(20));
        for (SessionId& id : queue) id = pick(30);
        const SessionId id = pick(30);
        const std::uint64_t kind = pick(10);
        if (kind < 5) {
          const std::uint64_t bytes = 1 + pick(300);
          const Ids before = p.sessions(Tier::dram);
          const std::size_t window = p.window_sessions();
          last_saved[id] = bytes;
          p.save(id, bytes, queue);
          if (policy == Policy::scheduler_aware) {
            std::set<SessionId> in_window;
            for (const SessionId q : queue) {
              if (in_window.size() >= window) break;
              in_window.insert(q);
            }
            const Ids after = p.sessions(Tier::dram);
            bool evicted_inside = false;
            for (const SessionId b : before) {
              if (b != id && !std::binary_search(after.begin(), after.end(), b) && in_window.contains(b)) {
                evicted_inside = true;
              }
            }
            if (evicted_inside) {  // then nothing outside the window was left in DRAM
              for (const SessionId a : after) {
                if (a != id) {
                  ASSERT_TRUE(in_window.contains(a)) << "seed " << seed << " op " << op;
                }
              }
            }
          }
        } else if (kind < 8) {
          p.access(id);
        } else if (kind < 9) {
          p.prefetch(queue, pick(2) == 0 ? 1000000 : pick(400));
        } else {
          p.drop(id);
        }
        check_invariants(p, last_saved);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(TraceSim, GeneratorIsDeterministicPerSeed) {
  ConversationModel model;
  model.conversations = 300;
  model.seed = 7;
  const Trace a = generate_trace(model);
  const Trace b = generate_trace(model);
  ASSERT_EQ(a.jobs.size(), b.jobs.size());
  for (std::size_t i = 0; i < a.jobs.size(); ++i) {
    EXPECT_EQ(a.jobs[i].time, b.jobs[i].time);
    EXPECT_EQ(a.jobs[i].session, b.jobs[i].session);
    EXPECT_EQ(a.jobs[i].turn, b.jobs[i].turn);
    EXPECT_EQ(a.jobs[i].prompt, b.jobs[i].prompt);
    EXPECT_EQ(a.jobs[i].answer, b.jobs[i].answer);
  }
  EXPECT_EQ(a.turns, b.turns);
  model.seed = 8;
  const Trace c = generate_trace(model);
  EXPECT_NE(a.turns, c.turns);
  // Jobs are in time order; each conversation's turns in order, its history the KV its earlier turns kept.
  std::unordered_map<SessionId, std::uint32_t> kept;
  for (std::size_t i = 0; i < a.jobs.size(); ++i) {
    const Job& job = a.jobs[i];
    if (i > 0) {
      EXPECT_LE(a.jobs[i - 1].time, job.time);
    }
    EXPECT_EQ(job.turn, job.turn == 1 ? 1u : (kept.contains(job.session) ? job.turn : 0u));
    EXPECT_EQ(job.history, kept[job.session]);
    EXPECT_LE(job.kept, model.max_context);
    EXPECT_EQ(job.last, job.turn == a.turns[job.session]);
    kept[job.session] = job.kept;
  }
}

TEST(TraceSim, MeanTurnsIsShareGptsFigure) {
  ConversationModel model;
  model.conversations = 40000;
  model.seed = 3;
  const Trace trace = generate_trace(model);
  double turns = 0;
  for (const std::uint32_t t : trace.turns) turns += t;
  const double mean = turns / static_cast<double>(trace.turns.size());
  EXPECT_NEAR(mean, 5.75, 0.05 * 5.75);
  EXPECT_EQ(trace.jobs.size(), static_cast<std::size_t>(turns));
  // The lognormal lengths have about the means asked for (clipping at 4096 takes little off).
  double prompt = 0, answer = 0;
  for (const Job& job : trace.jobs) {
    prompt += job.prompt;
    answer += job.answer;
  }
  EXPECT_NEAR(prompt / static_cast<double>(trace.jobs.size()), model.prompt_mean, 0.05 * model.prompt_mean);
  EXPECT_NEAR(answer / static_cast<double>(trace.jobs.size()), model.answer_mean, 0.05 * model.answer_mean);
}

SimResult run(const Trace& trace, Policy policy, double dram_gib, double disk_gib) {
  SimConfig config;
  config.placement.policy = policy;
  config.placement.dram_bytes = static_cast<std::uint64_t>(dram_gib * 1024 * 1024 * 1024);
  config.placement.disk_bytes = static_cast<std::uint64_t>(disk_gib * 1024 * 1024 * 1024);
  return simulate(trace, config);
}

double dram_rate(const SimResult& r) { return static_cast<double>(r.dram_hits) / static_cast<double>(r.returning); }

// At a capacity where the policies differ (96 GiB of DRAM, no disk): scheduler-aware > LRU > FIFO in DRAM hit rate,
// on a fixed seed.
TEST(TraceSim, SchedulerAwareBeatsLruBeatsFifo) {
  ConversationModel model;
  model.conversations = 1000;
  model.seed = 1;
  const Trace trace = generate_trace(model);
  const SimResult sa = run(trace, Policy::scheduler_aware, 96, 0);
  const SimResult lru = run(trace, Policy::lru, 96, 0);
  const SimResult fifo = run(trace, Policy::fifo, 96, 0);
  EXPECT_GT(dram_rate(sa), dram_rate(lru) + 0.02);  // 97.5% vs 93.6% vs 91.1% (docs/sessions.md)
  EXPECT_GT(dram_rate(lru), dram_rate(fifo) + 0.01);
  EXPECT_GT(lru.prefill_tokens_saved, fifo.prefill_tokens_saved);
  for (const SimResult* r : {&sa, &lru, &fifo}) {
    EXPECT_EQ(r->dram_hits + r->disk_hits + r->misses, r->returning);
    EXPECT_LE(r->peak_dram_bytes, static_cast<std::uint64_t>(96) << 30);
    EXPECT_EQ(r->disk_hits, 0u);
  }
  EXPECT_GT(sa.prefill_tokens_saved, lru.prefill_tokens_saved);
}

// With no look-ahead (an empty queue) every session is needed "never" and the recency tie break decides:
// scheduler-aware is LRU exactly.
TEST(TraceSim, SchedulerAwareWithoutLookaheadIsLru) {
  ConversationModel model;
  model.conversations = 400;
  const Trace trace = generate_trace(model);
  for (const double disk : {0.0, 8.0}) {
    SimConfig config;
    config.lookahead = 0;
    config.placement.dram_bytes = std::uint64_t{8} << 30;
    config.placement.disk_bytes = static_cast<std::uint64_t>(disk * 1024 * 1024 * 1024);
    config.placement.policy = Policy::scheduler_aware;
    const SimResult sa = simulate(trace, config);
    config.placement.policy = Policy::lru;
    const SimResult lru = simulate(trace, config);
    EXPECT_EQ(sa.dram_hits, lru.dram_hits);
    EXPECT_EQ(sa.disk_hits, lru.disk_hits);
    EXPECT_EQ(sa.misses, lru.misses);
    EXPECT_GT(sa.misses, 0u);
  }
}

// On many seeds and capacities: the counts add up, the peaks stay under the capacities, and scheduler-aware keeps
// at least LRU's DRAM hit rate less a small slack (it is no oracle: its look-ahead is 256 jobs).
TEST(TraceSim, InvariantsOnManySeeds) {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    ConversationModel model;
    model.conversations = 300;
    model.seed = seed;
    const Trace trace = generate_trace(model);
    for (const double dram : {4.0, 16.0}) {
      for (const double disk : {0.0, 16.0}) {
        double rate[3] = {};
        int k = 0;
        for (const Policy policy : {Policy::scheduler_aware, Policy::lru, Policy::fifo}) {
          const SimResult r = run(trace, policy, dram, disk);
          EXPECT_EQ(r.dram_hits + r.disk_hits + r.misses, r.returning);
          EXPECT_EQ(r.jobs, trace.jobs.size());
          EXPECT_LE(r.peak_dram_bytes, static_cast<std::uint64_t>(dram * 1024 * 1024 * 1024));
          EXPECT_LE(r.peak_disk_bytes, static_cast<std::uint64_t>(disk * 1024 * 1024 * 1024));
          EXPECT_LE(r.prefill_tokens_saved, r.prefill_tokens);
          rate[k++] = dram_rate(r);
        }
        EXPECT_GE(rate[0] + 0.02, rate[1]) << "seed " << seed << " dram " << dram << " disk " << disk;
      }
    }
  }
}

}  // namespace
