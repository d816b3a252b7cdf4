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
  explicit BuildQueue(int workers = 1);
  ~BuildQueue();  ///< runs the jobs still queued, then joins
  BuildQueue(const BuildQueue&) = delete;
  BuildQueue& operator=(const BuildQueue&) = delete;

  /// Enqueues a job; jobs must not throw (they record their own failures).
  void submit(std::function<void()> job);

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvret
