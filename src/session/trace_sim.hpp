// Synthetic multi-turn conversation traces and the replay of a trace against a Placement (docs/sessions.md).
// `kvret-session-sim` (tools/sessions) is the command line; the tests use the same code.
//
// The model:
// - Conversations arrive by a Poisson process (`arrival_rate` per second).
// - Turns per conversation: geometric on {1, 2, ...} with mean `mean_turns` (5.75, AttentionStore's ShareGPT figure).
// - The next turn of a conversation arrives a think time (mean `mean_think_s`, which includes the answer's
//   generation) after the previous one: exponential, or lognormal (heavier tailed) when `think_sigma` > 0.
// - Tokens: each turn adds a user prompt and an answer, lognormal with the given means and log-space sigmas, clipped
//   to [1, max_message_tokens]. A session's KV after a turn is its history + prompt + answer, truncated to the last
//   `max_context` tokens.
// - Jobs run in arrival order; when job i runs, the scheduler knows the sessions of jobs i+1 .. i+lookahead.
// Every random draw comes from std::mt19937_64 (whose output the standard fixes) turned into numbers here, not by
// the standard library's distributions (whose algorithms it leaves open), so a seed gives the same trace everywhere.
#pragma once

#include <cstdint>
#include <vector>

#include "session/placement.hpp"

namespace kvret::session {

struct ConversationModel {
  std::uint64_t conversations = 2000;
  double arrival_rate = 0.5;    // conversations per second
  double mean_turns = 5.75;     // geometric
  double mean_think_s = 120.0;  // between the arrivals of two turns of a conversation
  double think_sigma = 0;       // 0: exponential think times; > 0: lognormal with this log-space sigma, same mean
  double prompt_mean = 161.0;   // lognormal tokens per user prompt (ShareGPT mean input, as in the vLLM paper)
  double prompt_sigma = 1.0;
  double answer_mean = 338.0;  // lognormal tokens per answer (ShareGPT mean output)
  double answer_sigma = 0.8;
  std::uint32_t max_message_tokens = 4096;
  std::uint32_t max_context = 8192;  // Llama-3-8B's window: the KV kept is the last max_context tokens
  std::uint64_t seed = 1;
};

struct Job {
  double time = 0;            // arrival, seconds
  SessionId session = 0;      // the conversation
  std::uint32_t turn = 1;     // 1-based
  std::uint32_t history = 0;  // KV tokens saved by the earlier turns (after truncation); 0 on the first turn
  std::uint32_t prompt = 0;   // new prompt tokens: prefilled in any case
  std::uint32_t answer = 0;   // decoded tokens
  std::uint32_t kept = 0;     // KV tokens saved after this turn: min(history + prompt + answer, max_context)
  bool last = false;          // the conversation's last turn (the scheduler does not know it)
};

struct Trace {
  std::vector<Job> jobs;             // in arrival order (ties: by session, then turn)
  std::vector<std::uint32_t> turns;  // per conversation
};

Trace generate_trace(const ConversationModel& model);

struct SimConfig {
  PlacementConfig placement;
  std::uint64_t kv_bytes_per_token = 131072;  // Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
  std::size_t lookahead = 256;                // jobs the scheduler knows ahead
  double prefill_tokens_per_s = 10000.0;      // to turn saved prefill tokens into seconds
  // Prefetch bandwidth: between the starts of job i and job i + 1 the disk reads at most this many bytes per second
  // times the gap (unused reading time is carried over up to one largest session, so that a long load may span
  // gaps). 0: unlimited (every prefetch lands in time).
  double disk_read_bytes_per_s = 5e9;
  std::uint64_t max_session_tokens = 8192;  // the carry-over cap, in tokens (ConversationModel::max_context)
};

struct SimResult {
  std::uint64_t jobs = 0;
  std::uint64_t returning = 0;  // jobs with a history (turn > 1): the accesses
  std::uint64_t dram_hits = 0;
  std::uint64_t disk_hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t prefill_tokens = 0;        // prefilled without a store (history + prompt of every job)
  std::uint64_t prefill_tokens_saved = 0;  // history tokens of the hits
  double prefill_s_saved = 0;
  std::uint64_t prefetched_bytes = 0;
  std::uint64_t demoted_bytes = 0;
  std::uint64_t not_saved = 0;
  std::uint64_t peak_dram_bytes = 0;
  std::uint64_t peak_disk_bytes = 0;
};

// Replays `trace` in job order: access (turns > 1), save the grown KV, then prefetch for the queue (AttentionStore
// loads the window while the current job runs), within the bytes the disk can read before the next job starts.
// Jobs start at their arrival (the server keeps up).
SimResult simulate(const Trace& trace, const SimConfig& config);

}  // namespace kvret::session
