#include "engine/build_queue.hpp"

#include <string>
#include <system_error>

#include "core/error.hpp"

namespace kvret {

thread_local int g_worker_starts_until_failure = -1;

BuildQueue::BuildQueue(int workers) {
  try {
    workers_.reserve(static_cast<size_t>(workers > 0 ? workers : 0));
    for (int i = 0; i < workers; ++i) {
      if (g_worker_starts_until_failure == 0) {
        g_worker_starts_until_failure = -1;
        throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again), "injected");
      }
      if (g_worker_starts_until_failure > 0) --g_worker_starts_until_failure;
      workers_.emplace_back([this] { run(); });
    }
  } catch (const std::system_error& e) {
    stop();
    throw Error(KVRET_ERR_OUT_OF_MEMORY,
                std::string("cannot start the context's background build thread (the process's thread limit or "
                            "memory is exhausted): ") +
                    e.what());
  } catch (...) {
    stop();
    throw;
  }
}

BuildQueue::~BuildQueue() { stop(); }

void BuildQueue::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

void BuildQueue::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void BuildQueue::run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace kvret
