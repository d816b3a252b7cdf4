#include "session/disk_tier.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>

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

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) io_error("opening the directory " + dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) io_error("syncing the directory " + dir, err);
}

}  // namespace

DiskTier::DiskTier(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw Error(KVRET_ERR_IO, "disk tier: cannot create the directory " + dir_ + ": " + ec.message());
  DIR* d = ::opendir(dir_.c_str());
  if (d == nullptr) io_error("opening the directory " + dir_, errno);
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
    const std::string path = dir_ + "/" + name;
    if (name.size() > tmp && name.compare(name.size() - tmp, tmp, kTmpSuffix) == 0 && name[0] == 'b') {
      ::unlink(path.c_str());  // a put that never reached its rename
      continue;
    }
    const auto key = key_of(name);
    if (!key) continue;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    files_[*key] = st.st_size;
    bytes_ += st.st_size;
  }
}

std::string DiskTier::path_of(const std::string& key) const {
  require(!key.empty() && key.size() <= kMaxKeyBytes && key.find('\0') == std::string::npos, KVRET_ERR_INVALID_ARGUMENT,
          "disk tier: a key must have 1 to 120 bytes and no NUL");
  return dir_ + "/b" + hex(key) + kSuffix;
}

void DiskTier::put(const std::string& key, const std::byte* data, size_t size, int64_t ttl_ms) {
  const std::string path = path_of(key);
  const std::string tmp = path + "." + std::to_string(::getpid()) + kTmpSuffix;
  std::byte header[kHeaderBytes];
  store_le<uint32_t>(header, kBlobMagic);
  store_le<uint32_t>(header + 4, kBlobVersion);
  store_le<uint64_t>(header + 8, static_cast<uint64_t>(size));
  store_le<int64_t>(header + 16, ttl_ms > 0 ? now_ms() + ttl_ms : 0);
  store_le<uint32_t>(header + 24, crc32_of(data, size));
  store_le<uint32_t>(header + 28, crc32_of(header, 28));

  std::lock_guard<std::mutex> lock(mu_);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error("creating " + tmp, errno);
  try {
    write_all(fd, header, kHeaderBytes, tmp);
    write_all(fd, data, size, tmp);
    if (::fsync(fd) != 0) io_error("syncing " + tmp, errno);
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) io_error("closing " + tmp, errno);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    io_error("renaming " + tmp + " to " + path, err);
  }
  const auto file_bytes = static_cast<int64_t>(kHeaderBytes + size);
  const auto it = files_.find(key);
  bytes_ += file_bytes - (it == files_.end() ? 0 : it->second);
  files_[key] = file_bytes;
  ++writes_;
  // The rename is made durable; the blob is in place whether or not that succeeds, so a failure here is not the
  // put's (the old bytes are gone either way).
  try {
    fsync_dir(dir_);
  } catch (const Error&) {
  }
}

std::optional<std::vector<std::byte>> DiskTier::get(const std::string& key) {
  const std::string path = path_of(key);
  std::lock_guard<std::mutex> lock(mu_);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    io_error("opening " + path, errno);
  }
  std::vector<std::byte> bytes;
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0) io_error("reading the size of " + path, errno);
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
  const auto corrupt = [&](const char* what) {
    throw Error(KVRET_ERR_CORRUPT, "disk tier: " + path + " is corrupt: " + what);
  };
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
  const std::string path = path_of(key);
  std::lock_guard<std::mutex> lock(mu_);
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) {
      if (const auto it = files_.find(key); it != files_.end()) {
        bytes_ -= it->second;
        files_.erase(it);
      }
      return false;
    }
    io_error("removing " + path, errno);
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
