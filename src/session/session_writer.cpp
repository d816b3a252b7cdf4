// The session store's background writer (saves queued to the disk and shared tiers) and its scan of the disk tier
// at start-up (session_store.hpp).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/error.hpp"
#include "core/serial.hpp"
#include "session/session_layout.hpp"
#include "session/session_store.hpp"

namespace kvret::session {

using namespace session_detail;  // NOLINT: the layout's helpers (session_layout.hpp)

void SessionStore::wait_writer() {
  std::unique_lock<std::mutex> wlock(wmu_);
  wcv_.wait(wlock, [&] { return writes_.empty() && !writing_ && disk_writes_.empty() && !disk_writing_; });
}

bool SessionStore::queue_write(const Meta& meta, std::unique_ptr<Sequence>& copy, uint64_t bytes) {
  auto job = std::make_shared<SharedWrite>();
  job->serial = meta.save_serial;
  job->id = meta.id;
  job->meta = meta;
  job->bytes = bytes;
  std::vector<std::shared_ptr<SharedWrite>> superseded;  // freed after the lock
  {
    std::lock_guard<std::mutex> wlock(wmu_);
    if (!start_writer()) return false;
    // A queued write-through of an older save of this id is superseded (the one running finishes first).
    for (auto it = writes_.begin(); it != writes_.end();) {
      if ((*it)->id == job->id) {
        pending_bytes_ -= (*it)->bytes;
        superseded.push_back(std::move(*it));
        it = writes_.erase(it);
      } else {
        ++it;
      }
    }
    job->copy = std::move(copy);
    writes_.push_back(job);
    pending_bytes_ += bytes;
  }
  wcv_.notify_all();
  return true;
}

bool SessionStore::start_writer() {
  if (wstop_) return false;
  if (!writer_.joinable()) {
    try {
      writer_ = std::thread([this] { writer_loop(); });
    } catch (const std::system_error&) {
      return false;
    }
  }
  return true;
}

void SessionStore::commit_disk_write(const std::shared_ptr<DiskWrite>& job, const std::exception_ptr& failure) {
  const auto e = evicting_.find(job->sid);
  const bool current = e != evicting_.end() && e->second == job;
  if (failure) {  // nothing of it is on disk; a current one stays in DRAM, for a retry
    ++counters_.write_failures;
    if (current) {
      job->failed = true;
      ++job->tries;
      keep_failure(failure, job->tries < kEvictionTries
                                ? "session store: writing a session's files to the disk tier (it stays in DRAM; "
                                  "the next save or schedule tries again)"
                                : "session store: writing a session's files to the disk tier (it stays in DRAM; "
                                  "no more tries)");
    }
    return;
  }
  if (!current) return;  // dropped, saved again or moved back meanwhile: the writer wrote no manifest
  Meta& m = meta_.at(job->sid);
  // The older save's layers (its manifest is replaced by this one's when the stem is the same).
  if (m.disk) remove_blobs(*m.disk, ctx_.config().n_layers, m.disk->stem != job->rec.stem);
  m.disk = job->rec;
  evicting_.erase(e);  // its DRAM copy goes with the job
}

void SessionStore::retry_failed_writes() {
  std::vector<std::shared_ptr<DiskWrite>> again;
  for (const auto& [sid, job] : evicting_)
    if (job->failed && job->tries < kEvictionTries) again.push_back(job);
  if (again.empty()) return;
  {
    std::lock_guard<std::mutex> wlock(wmu_);
    if (!start_writer()) return;
    for (const std::shared_ptr<DiskWrite>& job : again) {
      disk_writes_.push_back(job);  // the same files: a failed write left none of them
      pending_bytes_ += job->bytes;
      job->failed = false;
    }
  }
  wcv_.notify_all();
}

void SessionStore::writer_loop() {
  std::unique_lock<std::mutex> wlock(wmu_);
  for (;;) {
    wcv_.wait(wlock, [&] { return wstop_ || !writes_.empty() || !disk_writes_.empty(); });
    if (!disk_writes_.empty()) {  // evictions first: they free DRAM
      std::shared_ptr<DiskWrite> job = std::move(disk_writes_.front());
      disk_writes_.pop_front();
      disk_writing_ = job;
      wlock.unlock();
      std::exception_ptr failure, cleanup;
      std::optional<std::vector<uint64_t>> sizes;  // the layers written
      if (const DiskWriteHook hook = g_disk_write_hook.load()) hook(job->meta.id.c_str());
      if (!job->cancelled) {
        try {
          sizes = write_layers(*job->copy, job->rec, &cleanup);
        } catch (...) {
          failure = std::current_exception();
        }
      }
      {
        // The manifest under the lock, and only for the current write of the session: a drop, a re-save or a
        // prefetch of it (which take the lock) come wholly before or wholly after.
        std::lock_guard<std::mutex> lock(mu_);
        if (cleanup) keep_failure(cleanup);
        if (sizes) {
          const auto e = evicting_.find(job->sid);
          if (e != evicting_.end() && e->second == job) {
            try {
              const std::vector<std::byte> manifest = manifest_bytes(job->meta, job->rec, *sizes);
              disk_->put(manifest_key(job->rec.stem), manifest.data(), manifest.size(), 0);
            } catch (...) {
              failure = std::current_exception();
              remove_layers(job->rec, ctx_.config().n_layers, nullptr);
            }
          } else {
            remove_layers(job->rec, ctx_.config().n_layers, nullptr);  // superseded: no manifest names them
          }
        }
        commit_disk_write(job, failure);
      }
      wlock.lock();
      pending_bytes_ -= job->bytes;
      disk_writing_.reset();
      job.reset();
      wcv_.notify_all();
      continue;
    }
    if (writes_.empty()) return;  // stopped, nothing left
    std::shared_ptr<SharedWrite> job = std::move(writes_.front());
    writes_.pop_front();
    writing_ = job;
    wlock.unlock();
    uint64_t generation = 0;
    std::exception_ptr failure;
    try {
      generation = write_shared(*job->copy, job->meta, job.get());
    } catch (...) {
      failure = std::current_exception();
    }
    job->copy.reset();  // its pages and index go
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure) {
        ++counters_.write_failures;
        keep_failure(failure, "kvret_session_save: the write-through to the shared tier");
      } else if (generation != 0) {
        ++counters_.shared_writes;
      }
      if (job->cleanup) keep_failure(job->cleanup, "session store cleanup (shared tier)");
      if (generation != 0)
        if (const auto id = ids_.find(job->id); id != ids_.end())
          if (const auto m = meta_.find(id->second); m != meta_.end() && m->second.save_serial == job->serial)
            m->second.shared = generation;  // the shared tier names this very save
    }
    wlock.lock();
    pending_bytes_ -= job->bytes;
    writing_.reset();
    wcv_.notify_all();
  }
}

void SessionStore::flush() {
  wait_writer();
  std::lock_guard<std::mutex> lock(mu_);
  if (deferred_status_ == KVRET_OK) return;
  const kvret_status status = deferred_status_;
  std::string message = std::move(deferred_message_);
  deferred_status_ = KVRET_OK;
  deferred_message_.clear();
  throw Error(status, message);
}

void SessionStore::scan_disk() {
  const kvret_config& c = ctx_.config();
  const std::vector<int32_t> expected = fingerprint(c);
  std::unordered_set<std::string> keep;  // layer keys of the sessions found (and of foreign ones)
  const std::vector<std::string> keys = disk_->keys();
  const int64_t now = now_ms();
  for (const std::string& key : keys) {
    if (key.size() < 3 || key.compare(key.size() - 2, 2, ".m") != 0) continue;
    const std::string stem = key.substr(0, key.size() - 2);
    std::optional<std::vector<std::byte>> bytes;
    try {
      bytes = disk_->get(key);
    } catch (const Error& e) {
      if (e.status() != KVRET_ERR_CORRUPT) throw;
      disk_->remove(key);  // a manifest is replaced whole: this one was damaged after it was written
      ++counters_.corrupt;
      continue;
    }
    if (!bytes) continue;
    try {
      ByteReader r(bytes->data(), bytes->size());
      read_header(r, kManifestTag, kLayoutVersion);
      const auto id_chars = r.array<char>();
      const std::string id(id_chars.begin(), id_chars.end());
      const auto generation = r.value<uint64_t>();
      const auto expires = r.value<int64_t>();
      const auto saved_bytes = r.value<uint64_t>();
      const auto print = r.array<int32_t>();
      if (print != expected) {  // another model's session: left alone
        const int32_t layers = print.empty() ? 0 : std::clamp(print[0], 0, 1 << 16);
        for (int32_t l = 0; l < layers; ++l) keep.insert(layer_key(stem, generation, l));
        continue;
      }
      const SessionId sid = id_of(id);
      const bool expired = expires != 0 && now >= expires;
      if (expired || meta_.count(sid) != 0 || id.empty()) {
        disk_->remove(key);
        if (expired) ++counters_.expired;
        continue;
      }
      if (placement_.save_to_disk(sid, std::max<uint64_t>(saved_bytes, 1), {}) != Tier::disk) {
        disk_->remove(key);  // no room at this capacity
        forget_if_unused(sid);
        continue;
      }
      Meta m;
      m.id = id;
      m.bytes = std::max<uint64_t>(saved_bytes, 1);
      m.expires_ms = expires;
      m.disk = DiskRecord{stem, generation};
      meta_.emplace(sid, std::move(m));
      for (int32_t l = 0; l < c.n_layers; ++l) keep.insert(layer_key(stem, generation, l));
    } catch (const Error& e) {
      if (e.status() != KVRET_ERR_CORRUPT) throw;
      disk_->remove(key);
      ++counters_.corrupt;
    }
  }
  // Layer blobs no manifest names: a save killed before its manifest, or the old generation of one killed after.
  for (const std::string& key : keys) {
    const size_t g = key.find(".g");
    if (g == std::string::npos || key.find(".l", g) == std::string::npos || keep.count(key) != 0) continue;
    disk_->remove(key);
  }
}

}  // namespace kvret::session
