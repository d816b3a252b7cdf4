#pragma once
// The context's background workers for index builds. Jobs run in FIFO order; each job parallelizes itself with
// OpenMP, so one worker (the default) keeps the cores busy without oversubscribing them.
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvret {

class BuildQueue {
 public:
  /// Starts the workers. When the system cannot start one (std::thread throws std::system_error: the process's
  /// thread limit, or no memory for its stack), the workers already started are stopped and joined and
  /// Error(KVRET_ERR_OUT_OF_MEMORY) is thrown; any other exception is rethrown after the same cleanup.
  explicit BuildQueue(int workers = 1);
  ~BuildQueue();  ///< runs the jobs still queued, then joins
  BuildQueue(const BuildQueue&) = delete;
  BuildQueue& operator=(const BuildQueue&) = delete;

  /// Enqueues a job; jobs must not throw (they record their own failures).
  void submit(std::function<void()> job);

 private:
  void run();
  void stop() noexcept;  ///< lets the workers finish the queued jobs and joins them
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

/// Fault injection for tests: while >= 0, the calling thread's n-th worker start from now (in any BuildQueue it
/// constructs) fails as a failed pthread_create does, with std::system_error (0: the next one). -1: off.
extern thread_local int g_worker_starts_until_failure;

}  // namespace kvret
