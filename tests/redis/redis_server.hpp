#pragma once
// A redis-server child process on loopback for the Redis tier's tests and benchmark: a free port, its own temporary
// directory (removed at the end), no snapshots, optionally the append-only file; killed with the process that
// started it. A raw hiredis connection to look at (and tamper with) the keys. And a slow loopback proxy that passes
// the client's bytes on at once but trickles the server's back, one byte at a time.
#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvret_test {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline std::string find_redis_server() {
  if (const char* env = std::getenv("KVRET_REDIS_SERVER"); env != nullptr && *env != '\0') return env;
  std::string path = std::getenv("PATH") != nullptr ? std::getenv("PATH") : "";
  path += ":/usr/bin:/usr/sbin:/usr/local/bin";
  size_t start = 0;
  while (start <= path.size()) {
    const size_t end = std::min(path.find(':', start), path.size());
    const fs::path candidate = fs::path(path.substr(start, end - start)) / "redis-server";
    if (end > start && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    start = end + 1;
  }
  return "";
}

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

// A raw connection for looking at (and tampering with) the keys directly.
class Raw {
 public:
  explicit Raw(int port) {
    const timeval tv{2, 0};
    ctx_ = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (ctx_ != nullptr && ctx_->err == 0) redisSetTimeout(ctx_, tv);
  }
  ~Raw() {
    if (ctx_ != nullptr) redisFree(ctx_);
  }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  bool ok() const { return ctx_ != nullptr && ctx_->err == 0; }

  // The reply to a command given as arguments; nullptr on a lost connection.
  std::unique_ptr<redisReply, void (*)(redisReply*)> cmd(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<size_t> argl;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      argl.push_back(a.size());
    }
    void* r = ok() ? redisCommandArgv(ctx_, static_cast<int>(args.size()), argv.data(), argl.data()) : nullptr;
    return {static_cast<redisReply*>(r), [](redisReply* p) {
              if (p != nullptr) freeReplyObject(p);
            }};
  }
  std::vector<std::string> keys(const std::string& pattern) {
    std::vector<std::string> out;
    const auto r = cmd({"KEYS", pattern});
    if (r && r->type == REDIS_REPLY_ARRAY)
      for (size_t i = 0; i < r->elements; ++i) out.emplace_back(r->element[i]->str, r->element[i]->len);
    return out;
  }
  long long integer(const std::vector<std::string>& args) {
    const auto r = cmd(args);
    return r && r->type == REDIS_REPLY_INTEGER ? r->integer : -999;
  }

 private:
  redisContext* ctx_ = nullptr;
};

class RedisServer {
 public:
  struct Options {
    bool persistent = false;  // appendonly yes
    std::vector<std::string> extra;
  };

  explicit RedisServer(Options options) : options_(std::move(options)) {
    char tmpl[] = "/tmp/kvret-redis-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) dir_ = tmpl;
  }
  ~RedisServer() {
    kill9();
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  // Starts the server (on a fresh free port the first time, on the same port after that); false when it does not
  // answer PING within a few seconds. Call it from the test's main thread: the child is killed when the thread that
  // started it ends.
  bool start() {
    if (dir_.empty()) return false;
    for (int attempt = 0; attempt < 8; ++attempt) {
      if (port_ == 0 || (attempt > 0 && !started_once_)) port_ = free_port();
      if (port_ == 0) continue;
      if (launch() && wait_ready()) {
        started_once_ = true;
        return true;
      }
      kill9();
      if (started_once_) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // same port: try again
    }
    return false;
  }

  void kill9() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
  }
  void signal(int sig) const {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  int port() const { return port_; }
  std::string url(const std::string& tail = "") const { return "redis://127.0.0.1:" + std::to_string(port_) + tail; }
  std::string log() const {
    std::string text;
    if (FILE* f = std::fopen((dir_ + "/redis.log").c_str(), "r")) {
      char buf[4096];
      size_t n = 0;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
      std::fclose(f);
    }
    return text;
  }

 private:
  bool launch() {
    const std::string binary = find_redis_server();
    std::vector<std::string> args = {binary,
                                     "--port",
                                     std::to_string(port_),
                                     "--bind",
                                     "127.0.0.1",
                                     "--dir",
                                     dir_,
                                     "--daemonize",
                                     "no",
                                     "--save",
                                     "",
                                     "--appendonly",
                                     options_.persistent ? "yes" : "no",
                                     "--logfile",
                                     dir_ + "/redis.log"};
    args.insert(args.end(), options_.extra.begin(), options_.extra.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) return false;
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the server dies with the test
      if (::getppid() != parent) ::_exit(127);
      const int devnull = ::open("/dev/null", O_RDWR);
      if (devnull >= 0) {
        ::dup2(devnull, 0);
        ::dup2(devnull, 1);
        ::dup2(devnull, 2);
      }
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    pid_ = pid;
    return true;
  }

  bool wait_ready() {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {  // exited: the port was taken, or a bad option
        pid_ = -1;
        return false;
      }
      Raw raw(port_);
      if (raw.ok()) {
        const auto r = raw.cmd({"PING"});
        // PONG from this child, not from another test's server that took the port meanwhile (ours then exits)
        if (r && r->type == REDIS_REPLY_STATUS && std::string(r->str, r->len) == "PONG" && answers_as_ours(raw))
          return true;
        if (r && r->type == REDIS_REPLY_ERROR && std::string(r->str, r->len).rfind("NOAUTH", 0) == 0) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  /// Whether the server behind `raw` is this child (INFO's process_id).
  bool answers_as_ours(Raw& raw) const {
    const auto r = raw.cmd({"INFO", "server"});
    if (!r || r->type != REDIS_REPLY_STRING) return false;
    const std::string info(r->str, r->len);
    return info.find("process_id:" + std::to_string(pid_) + "\r\n") != std::string::npos;
  }

  Options options_;
  std::string dir_;
  int port_ = 0;
  bool started_once_ = false;
  pid_t pid_ = -1;
};

// A TCP proxy on a free loopback port in front of 127.0.0.1:`upstream`: what a client sends goes on at once, what
// the server answers comes back one byte every `delay` (a slow link, or a server that stalls mid-reply). One thread
// per connection; the destructor ends them all.
class SlowProxy {
 public:
  SlowProxy(int upstream, std::chrono::milliseconds delay) : upstream_(upstream), delay_(delay) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listen_fd_, 16) != 0 || ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
      return;
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~SlowProxy() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (std::thread& t : links_) t.join();
    if (listen_fd_ >= 0) ::close(listen_fd_);
  }
  SlowProxy(const SlowProxy&) = delete;
  SlowProxy& operator=(const SlowProxy&) = delete;

  int port() const { return port_; }  // 0: it could not listen
  std::string url(const std::string& tail = "") const { return "redis://127.0.0.1:" + std::to_string(port_) + tail; }

 private:
  void accept_loop() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      std::lock_guard<std::mutex> lock(mu_);
      links_.emplace_back([this, client] { relay(client); });
    }
  }

  void relay(int client) {
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(upstream_));
    if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      if (server >= 0) ::close(server);
      ::close(client);
      return;
    }
    std::string pending;  // the server's bytes not yet passed on
    auto next_byte = Clock::now();
    char buf[65536];
    bool open = true;
    while (!stop_ && open) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      ::poll(p, 2, 10);
      if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = ::recv(client, buf, sizeof buf, 0);
        if (n <= 0 || ::send(server, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) open = false;
      }
      if ((p[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = ::recv(server, buf, sizeof buf, 0);
        if (n <= 0)
          open = false;
        else
          pending.append(buf, static_cast<size_t>(n));
      }
      if (!pending.empty() && Clock::now() >= next_byte) {
        if (::send(client, pending.data(), 1, MSG_NOSIGNAL) != 1) open = false;
        pending.erase(0, 1);
        next_byte = Clock::now() + delay_;
      }
    }
    ::close(server);
    ::close(client);
  }

  int upstream_;
  std::chrono::milliseconds delay_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> links_;
};

}  // namespace kvret_test
