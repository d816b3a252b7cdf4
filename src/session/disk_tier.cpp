#include "session/disk_tier.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include "core/checksum.hpp"
#include "core/error.hpp"

namespace kvret::session {

namespace {

constexpr uint32_t kBlobMagic = 0x4253564bu;  // "KVSB"
constexpr uint32_t kBlobVersion = 1;
constexpr size_t kHeaderBytes = 32;
constexpr const char* kSuffix = ".kvb";
constexpr const char* kTmpSuffix = ".tmp";

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void io_error(const std::string& what, int err) {
  std::string m = "disk tier: " + what + ": " + std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) m += " (the disk is full)";
  throw Error(KVRET_ERR_IO, m);
}

std::string hex(const std::string& key) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(key.size() * 2);
  for (const char c : key) {
    const auto b = static_cast<unsigned char>(c);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

/// The key of a blob file name, or nullopt for a name that is not one.
std::optional<std::string> key_of(const std::string& name) {
  const size_t suffix = std::strlen(kSuffix);
  if (name.size() < 1 + suffix || name[0] != 'b' || name.compare(name.size() - suffix, suffix, kSuffix) != 0)
    return std::nullopt;
  const std::string digits = name.substr(1, name.size() - 1 - suffix);
  if (digits.empty() || digits.size() % 2 != 0) return std::nullopt;
  std::string key;
  for (size_t i = 0; i < digits.size(); i += 2) {
    int v = 0;
    for (size_t j = 0; j < 2; ++j) {
      const char c = digits[i + j];
      int d = 0;
      if (c >= '0' && c <= '9')
        d = c - '0';
      else if (c >= 'a' && c <= 'f')
        d = c - 'a' + 10;
      else
        return std::nullopt;
      v = v * 16 + d;
    }
    key += static_cast<char>(v);
  }
  return key;
}

void write_all(int fd, const std::byte* data, size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      io_error("writing " + path, errno);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// A random 16-hex-digit part of a temporary file's name (nobody can plant a file or a link there beforehand).
std::string random_name_part() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[static_cast<size_t>(i)] = digits[(v >> (4 * i)) & 15];
  return s;
}

// Creates `dir` and its missing parents, each 0700 (a directory that exists is left as it is).
void make_private_dirs(const std::string& dir) {
  std::string path;
  size_t pos = 0;
  while (pos <= dir.size()) {
    const size_t slash = std::min(dir.find('/', pos), dir.size());
    path = dir.substr(0, slash);
    pos = slash + 1;
    if (path.empty() || path == "." || path == "..") continue;
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
      const int err = errno;
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) io_error("cannot create the directory " + path, err);
    }
  }
}

}  // namespace

DiskTier::DiskTier(std::string dir) : dir_(std::move(dir)) {
  require(!dir_.empty(), KVRET_ERR_INVALID_ARGUMENT, "config.disk_path: an empty path");
  make_private_dirs(dir_);
  dir_fd_ = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd_ < 0) {
    if (errno == ENOTDIR) throw Error(KVRET_ERR_INVALID_ARGUMENT, "config.disk_path: " + dir_ + " is not a directory");
    io_error("opening the directory " + dir_, errno);
  }
  try {
    // Saved sessions hold conversations: the directory must be this user's alone (docs/reliability.md).
    struct stat st {};
    if (::fstat(dir_fd_, &st) != 0) io_error("reading the owner of " + dir_, errno);
    if (st.st_uid != ::geteuid())
      throw Error(KVRET_ERR_INVALID_ARGUMENT, "config.disk_path: the directory " + dir_ + " belongs to user id " +
                                                  std::to_string(st.st_uid) + ", not to this process's user (" +
                                                  std::to_string(::geteuid()) +
                                                  "): kvret keeps sessions only in a "
                                                  "directory of its own user");
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      throw Error(KVRET_ERR_INVALID_ARGUMENT, "config.disk_path: the directory " + dir_ + " (mode " + mode +
                                                  ") can be written by its group or others, who could plant or replace "
                                                  "session files: chmod go-w it (0700 is what kvret creates)");
    }
    // One context per directory: a second one would remove the first one's temporary files and reuse its names.
    lock_fd_ = ::openat(dir_fd_, kLockName, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (lock_fd_ < 0) io_error("opening the lock file " + dir_ + "/" + kLockName, errno);
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK)
        throw Error(KVRET_ERR_BUSY, "config.disk_path: the directory " + dir_ +
                                        " is in use by another kvret context (in this process or another); one "
                                        "directory serves one context at a time");
      io_error("locking " + dir_ + "/" + kLockName, errno);
    }

    const int list_fd = ::openat(dir_fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR* d = list_fd < 0 ? nullptr : ::fdopendir(list_fd);
    if (d == nullptr) {
      const int err = errno;
      if (list_fd >= 0) ::close(list_fd);
      io_error("opening the directory " + dir_, err);
    }
    std::vector<std::string> names;
    try {
      while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    } catch (...) {
      ::closedir(d);
      throw;
    }
    ::closedir(d);
    const size_t tmp = std::strlen(kTmpSuffix);
    for (const std::string& name : names) {
      if (name.size() > tmp && name.compare(name.size() - tmp, tmp, kTmpSuffix) == 0 && name[0] == 'b') {
        ::unlinkat(dir_fd_, name.c_str(), 0);  // a put that never reached its rename (a link itself, not its target)
        continue;
      }
      const auto key = key_of(name);
      if (!key) continue;
      if (::fstatat(dir_fd_, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      // anything but a regular file is still listed (as a blob that reads as corrupt), so that it is removed
      const int64_t size = S_ISREG(st.st_mode) ? static_cast<int64_t>(st.st_size) : 0;
      files_[*key] = size;
      bytes_ += size;
    }
  } catch (...) {
    if (lock_fd_ >= 0) ::close(lock_fd_);
    ::close(dir_fd_);
    throw;
  }
}

DiskTier::~DiskTier() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
  if (dir_fd_ >= 0) ::close(dir_fd_);
}

std::string DiskTier::name_of(const std::string& key) const {
  require(!key.empty() && key.size() <= kMaxKeyBytes && key.find('\0') == std::string::npos, KVRET_ERR_INVALID_ARGUMENT,
          "disk tier: a key must have 1 to 120 bytes and no NUL");
  std::string name = "b";
  name += hex(key);
  name += kSuffix;
  return name;
}

void DiskTier::put(const std::string& key, const std::byte* data, size_t size, int64_t ttl_ms) {
  const std::string name = name_of(key);
  const std::string path = dir_ + "/" + name;
  std::byte header[kHeaderBytes];
  store_le<uint32_t>(header, kBlobMagic);
  store_le<uint32_t>(header + 4, kBlobVersion);
  store_le<uint64_t>(header + 8, static_cast<uint64_t>(size));
  store_le<int64_t>(header + 16, ttl_ms > 0 ? now_ms() + ttl_ms : 0);
  store_le<uint32_t>(header + 24, crc32_of(data, size));
  store_le<uint32_t>(header + 28, crc32_of(header, 28));

  std::lock_guard<std::mutex> lock(mu_);
  // a fresh name, created here and nowhere else (O_EXCL), never through a link (O_NOFOLLOW), readable by this user
  // only
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    tmp = name + "." + random_name_part() + kTmpSuffix;
    fd = ::openat(dir_fd_, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && (errno != EEXIST || attempt == 8)) io_error("creating " + dir_ + "/" + tmp, errno);
  }
  try {
    write_all(fd, header, kHeaderBytes, tmp);
    write_all(fd, data, size, tmp);
    if (::fsync(fd) != 0) io_error("syncing " + dir_ + "/" + tmp, errno);
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) io_error("closing " + dir_ + "/" + tmp, errno);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlinkat(dir_fd_, tmp.c_str(), 0);
    throw;
  }
  // rename replaces whatever entry has the blob's name (a link planted there is replaced, its target untouched)
  if (::renameat(dir_fd_, tmp.c_str(), dir_fd_, name.c_str()) != 0) {
    const int err = errno;
    ::unlinkat(dir_fd_, tmp.c_str(), 0);
    io_error("renaming " + dir_ + "/" + tmp + " to " + path, err);
  }
  const auto file_bytes = static_cast<int64_t>(kHeaderBytes + size);
  const auto it = files_.find(key);
  bytes_ += file_bytes - (it == files_.end() ? 0 : it->second);
  files_[key] = file_bytes;
  ++writes_;
  // The rename is made durable; the blob is in place whether or not that succeeds, so a failure here is not the
  // put's (the old bytes are gone either way).
  (void)::fsync(dir_fd_);
}

std::optional<std::vector<std::byte>> DiskTier::get(const std::string& key) {
  const std::string path = dir_ + "/" + name_of(key);
  const auto corrupt = [&](const char* what) {
    throw Error(KVRET_ERR_CORRUPT, "disk tier: " + path + " is corrupt: " + what);
  };
  std::lock_guard<std::mutex> lock(mu_);
  // no link followed, no wait on a FIFO or a device: only a regular file is read
  const int fd = ::openat(dir_fd_, name_of(key).c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    if (errno == ELOOP) corrupt("a symbolic link, not a file kvret wrote");
    io_error("opening " + path, errno);
  }
  std::vector<std::byte> bytes;
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0) io_error("reading the size of " + path, errno);
    if (!S_ISREG(st.st_mode)) corrupt("not a regular file");
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) io_error("opening " + path, errno);
    bytes.resize(static_cast<size_t>(st.st_size));
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        io_error("reading " + path, errno);
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    bytes.resize(done);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  ++reads_;
  if (bytes.size() < kHeaderBytes) corrupt("truncated header");
  if (load_le<uint32_t>(bytes.data()) != kBlobMagic) corrupt("not a kvret blob");
  if (load_le<uint32_t>(bytes.data() + 28) != crc32_of(bytes.data(), 28)) corrupt("header checksum mismatch");
  if (load_le<uint32_t>(bytes.data() + 4) != kBlobVersion) corrupt("a layout version this kvret does not read");
  const auto size = load_le<uint64_t>(bytes.data() + 8);
  if (size != bytes.size() - kHeaderBytes) corrupt("truncated or extended payload");
  if (load_le<uint32_t>(bytes.data() + 24) != crc32_of(bytes.data() + kHeaderBytes, size))
    corrupt("payload checksum mismatch");
  const auto expires = load_le<int64_t>(bytes.data() + 16);
  if (expires != 0 && now_ms() >= expires) return std::nullopt;  // expired: a miss (the owner removes it)
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(kHeaderBytes));
  return bytes;
}

bool DiskTier::remove(const std::string& key) {
  const std::string name = name_of(key);
  std::lock_guard<std::mutex> lock(mu_);
  // unlinkat removes the entry itself: a link, never its target
  if (::unlinkat(dir_fd_, name.c_str(), 0) != 0) {
    if (errno == ENOENT) {
      if (const auto it = files_.find(key); it != files_.end()) {
        bytes_ -= it->second;
        files_.erase(it);
      }
      return false;
    }
    io_error("removing " + dir_ + "/" + name, errno);
  }
  if (const auto it = files_.find(key); it != files_.end()) {
    bytes_ -= it->second;
    files_.erase(it);
  }
  return true;
}

std::vector<std::string> DiskTier::keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.reserve(files_.size());
  for (const auto& [key, bytes] : files_) out.push_back(key);
  return out;
}

int64_t DiskTier::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}
int64_t DiskTier::reads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reads_;
}
int64_t DiskTier::writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return writes_;
}

}  // namespace kvret::session
