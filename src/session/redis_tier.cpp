#include "session/redis_tier.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstring>
#include <string_view>
#include <utility>

#include "core/checksum.hpp"
#include "core/error.hpp"

#if KVRET_WITH_HIREDIS
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <mutex>
#endif

namespace kvret::session {

// ---- the URL ----------------------------------------------------------------------------------------------------

namespace {

[[noreturn]] void bad_url(const std::string& what) {
  throw Error(KVRET_ERR_INVALID_ARGUMENT, "session_shared_url: " + what);
}

int hex_digit(char ch) {
  if (ch >= '0' && ch <= '9') return ch - '0';
  if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
  if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
  return -1;
}

// Decodes %XX escapes. `part` names the part for messages (its text is not repeated: it may be a password).
std::string percent_decode(std::string_view text, const char* part) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out.push_back(text[i]);
      continue;
    }
    if (i + 2 >= text.size()) bad_url(std::string("a bad %-escape in the ") + part);
    const int hi = hex_digit(text[i + 1]);
    const int lo = hex_digit(text[i + 2]);
    if (hi < 0 || lo < 0) bad_url(std::string("a bad %-escape in the ") + part);
    const char decoded = static_cast<char>(hi * 16 + lo);
    if (decoded == '\0') bad_url(std::string("%00 in the ") + part);
    out.push_back(decoded);
    i += 2;
  }
  return out;
}

// A decimal integer in [lo, hi], the whole of `text`.
bool parse_int(std::string_view text, long long lo, long long hi, long long& out) {
  if (text.empty() || text.size() > 18) return false;
  for (const char ch : text)
    if (ch < '0' || ch > '9') return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size() && out >= lo && out <= hi;
}

bool host_char(char ch) {
  return std::isalnum(static_cast<unsigned char>(ch)) != 0 || ch == '.' || ch == '-' || ch == '_';
}

}  // namespace

RedisEndpoint parse_redis_url(const std::string& url) {
  RedisEndpoint ep;
  for (const char ch : url)
    if (static_cast<unsigned char>(ch) <= 0x20 || ch == 0x7f) bad_url("spaces or control characters in the URL");
  std::string_view rest = url;
  const auto starts_with_ci = [&](std::string_view prefix) {
    if (rest.size() < prefix.size()) return false;
    for (size_t i = 0; i < prefix.size(); ++i)
      if (std::tolower(static_cast<unsigned char>(rest[i])) != prefix[i]) return false;
    return true;
  };
  if (starts_with_ci("redis://")) {
    rest.remove_prefix(8);
  } else if (starts_with_ci("rediss://")) {
    ep.tls = true;
    rest.remove_prefix(9);
  } else {
    bad_url("the URL must start with redis:// or rediss://");
  }
  if (rest.find('#') != std::string_view::npos) bad_url("a '#' fragment is not accepted");

  std::string_view query;
  if (const size_t q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  std::string_view path;
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    path = rest.substr(slash + 1);
    rest = rest.substr(0, slash);
  }
  std::string_view authority = rest;

  if (const size_t at = authority.rfind('@'); at != std::string_view::npos) {
    const std::string_view userinfo = authority.substr(0, at);
    authority = authority.substr(at + 1);
    const size_t colon = userinfo.find(':');
    if (colon == std::string_view::npos) bad_url("the user part must be [username]:password@");
    ep.username = percent_decode(userinfo.substr(0, colon), "username");
    ep.password = percent_decode(userinfo.substr(colon + 1), "password");
    if (ep.password.empty()) bad_url("an empty password after ':'");
  }

  std::string_view port_text;
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == std::string_view::npos) bad_url("an IPv6 host without its closing ']'");
    const std::string_view host = authority.substr(1, close - 1);
    if (host.empty()) bad_url("an empty IPv6 host");
    for (const char ch : host)
      if (hex_digit(ch) < 0 && ch != ':' && ch != '.') bad_url("a bad character in the IPv6 host");
    ep.host = std::string(host);
    const std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') bad_url("text after the IPv6 host's ']'");
      port_text = after.substr(1);
      if (port_text.empty()) bad_url("an empty port after ':'");
    }
  } else {
    std::string_view host = authority;
    if (const size_t colon = authority.find(':'); colon != std::string_view::npos) {
      host = authority.substr(0, colon);
      port_text = authority.substr(colon + 1);
      if (port_text.empty()) bad_url("an empty port after ':'");
    }
    if (host.empty()) bad_url("no host");
    for (const char ch : host)
      if (!host_char(ch)) bad_url("a bad character in the host '" + std::string(host) + "'");
    ep.host = std::string(host);
  }
  if (!port_text.empty()) {
    long long port = 0;
    if (!parse_int(port_text, 1, 65535, port)) bad_url("the port '" + std::string(port_text) + "' is not in 1..65535");
    ep.port = static_cast<int>(port);
  }

  if (!path.empty()) {
    long long db = 0;
    if (!parse_int(path, 0, 2147483647, db))
      bad_url("the database '" + std::string(path) + "' is not a number in 0..2147483647");
    ep.db = static_cast<int>(db);
  }

  bool seen_prefix = false;
  bool seen_timeout = false;
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (pair.empty()) continue;
    const size_t eq = pair.find('=');
    if (eq == std::string_view::npos) bad_url("the query parameter '" + std::string(pair) + "' has no '='");
    const std::string_view name = pair.substr(0, eq);
    const std::string_view value = pair.substr(eq + 1);
    if (name == "prefix") {
      if (seen_prefix) bad_url("prefix given twice");
      seen_prefix = true;
      ep.prefix = percent_decode(value, "prefix");
      if (ep.prefix.empty()) bad_url("an empty prefix");
    } else if (name == "timeout_ms") {
      if (seen_timeout) bad_url("timeout_ms given twice");
      seen_timeout = true;
      long long ms = 0;
      if (!parse_int(value, 1, 3'600'000, ms))
        bad_url("timeout_ms '" + std::string(value) + "' is not a number in 1..3600000");
      ep.timeout_ms = static_cast<int>(ms);
    } else {
      bad_url("unknown query parameter '" + std::string(name) + "' (known: prefix, timeout_ms)");
    }
  }
  return ep;
}

std::unique_ptr<RedisTier> open_shared_tier(const char* url) {
  if (url == nullptr || url[0] == '\0') return nullptr;
  return std::make_unique<RedisTier>(parse_redis_url(url));
}

std::string RedisEndpoint::describe() const {
  const bool v6 = host.find(':') != std::string::npos;
  return std::string(tls ? "rediss://" : "redis://") + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port) +
         "/" + std::to_string(db);
}

// ---- keys ---------------------------------------------------------------------------------------------------------

std::string RedisTier::head_key(const std::string& key) const { return endpoint_.prefix + ":h:" + key; }

std::string RedisTier::chunk_key(const std::string& key, uint64_t version, size_t i) const {
  char ver[17];
  static constexpr char kHex[] = "0123456789abcdef";
  for (int d = 0; d < 16; ++d) ver[d] = kHex[(version >> (60 - 4 * d)) & 0xf];
  ver[16] = '\0';
  return endpoint_.prefix + ":c:" + key + ":v" + ver + ":" + std::to_string(i);
}

#if KVRET_WITH_HIREDIS

bool redis_tier_available() noexcept { return true; }

namespace {

constexpr char kMagic[4] = {'K', 'V', 'R', 'B'};
constexpr uint32_t kFormat = 1;
constexpr int kReadAttempts = 5;
constexpr size_t kMaxChunkBytes = size_t{512} << 20;
constexpr size_t kPipelineBytes = size_t{16} << 20;  // bytes of chunks in flight on one connection
// The largest head this tier writes or reads (a blob of up to about a million chunks): a longer reply to a head's
// GET is refused as it arrives instead of being buffered whole.
constexpr size_t kMaxHeadBytes = size_t{4} << 20;
constexpr size_t kSmallReply = size_t{64} << 10;  // a status, an integer or an error
constexpr size_t kBulkFraming = 32;               // "$<length>\r\n" and "\r\n" around a bulk string
constexpr size_t kReadSlack = size_t{64} << 10;   // bytes of the next pipelined replies one read may bring along
using Clock = std::chrono::steady_clock;

// The head value: little-endian fields, then the CRC-32 of everything before it.
struct Head {
  uint64_t version = 0;
  uint64_t size = 0;
  uint64_t chunk_bytes = 0;
  std::vector<uint32_t> crcs;  // one per chunk

  uint64_t chunk_size(size_t i) const {
    return i + 1 < crcs.size() ? chunk_bytes : size - chunk_bytes * (crcs.size() - 1);
  }
};

template <class T>
void put_le(std::string& out, T v) {
  char b[sizeof(T)];
  store_le<T>(b, v);
  out.append(b, sizeof b);
}

std::string encode_head(const Head& h) {
  std::string out(kMagic, sizeof kMagic);
  put_le<uint32_t>(out, kFormat);
  put_le<uint64_t>(out, h.version);
  put_le<uint64_t>(out, h.size);
  put_le<uint64_t>(out, h.chunk_bytes);
  put_le<uint64_t>(out, h.crcs.size());
  for (const uint32_t c : h.crcs) put_le<uint32_t>(out, c);
  put_le<uint32_t>(out, crc32_of(out.data(), out.size()));
  return out;
}

// std::nullopt when the value is not a whole, self-consistent head.
std::optional<Head> decode_head(const char* p, size_t len) {
  constexpr size_t kFixed = 4 + 4 + 8 + 8 + 8 + 8;
  if (len < kFixed + 4 || std::memcmp(p, kMagic, 4) != 0 || load_le<uint32_t>(p + 4) != kFormat) return std::nullopt;
  Head h;
  h.version = load_le<uint64_t>(p + 8);
  h.size = load_le<uint64_t>(p + 16);
  h.chunk_bytes = load_le<uint64_t>(p + 24);
  const uint64_t n = load_le<uint64_t>(p + 32);
  if (n > (len - kFixed - 4) / 4 || len != kFixed + 4 * n + 4) return std::nullopt;
  if (load_le<uint32_t>(p + len - 4) != crc32_of(p, len - 4)) return std::nullopt;
  if (h.chunk_bytes == 0 || h.chunk_bytes > kMaxChunkBytes) return std::nullopt;
  if (n != (h.size + h.chunk_bytes - 1) / h.chunk_bytes) return std::nullopt;
  h.crcs.resize(n);
  for (uint64_t i = 0; i < n; ++i) h.crcs[i] = load_le<uint32_t>(p + kFixed + 4 * i);
  return h;
}

// hiredis writes with write(2): a server that went away raises SIGPIPE, whose default action ends the process. The
// calling thread blocks it for the duration of a call and takes a SIGPIPE the call raised, so nothing of the
// process's signal handling changes.
class SigpipeBlock {
 public:
  SigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigemptyset(&pending);
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  ~SigpipeBlock() {
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        while (sigtimedwait(&pipe_, nullptr, &zero) == -1 && errno == EINTR) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
  bool was_pending_ = false;
};

struct ReplyFree {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

// hiredis makes an array reply's element table when the array's header arrives ("*N\r\n"), before any element:
// a server claiming 2^31 - 1 elements in 13 bytes had the client allocate 16 GiB, and freeing it walked every entry.
// The tier's longest array is EXEC's (a PERSIST per chunk and the head), so the reader refuses a longer one there.
constexpr size_t kMaxReplyElements = (kMaxHeadBytes - 44) / 4 + 2;

template <class F>
struct CountOf;
template <class R, class Task, class N>
struct CountOf<R (*)(Task, N)> {
  using type = N;
};
using ArrayCount = CountOf<decltype(redisReplyObjectFunctions{}.createArray)>::type;

// The reader's functions with createArray bounded; the others are hiredis's own (taken from the first reader).
redisReplyObjectFunctions g_bounded_functions;
void* (*g_create_array)(const redisReadTask*, ArrayCount) = nullptr;
thread_local uint64_t t_refused_elements = 0;  // the count of the array refused on this thread, 0 when none

void* bounded_create_array(const redisReadTask* task, ArrayCount elements) {
  if (static_cast<uint64_t>(elements) > kMaxReplyElements) {
    t_refused_elements = static_cast<uint64_t>(elements);
    return nullptr;  // the reader fails (hiredis calls it out of memory); Connection::reply names the cause
  }
  return g_create_array(task, elements);
}

void bound_reader(redisReader* reader) {
  static std::once_flag once;
  std::call_once(once, [&] {
    g_bounded_functions = *reader->fn;
    g_create_array = reader->fn->createArray;
    g_bounded_functions.createArray = bounded_create_array;
  });
  reader->fn = &g_bounded_functions;
}

bool is_status(const redisReply& r, const char* text) {
  return r.type == REDIS_REPLY_STATUS && r.len == std::strlen(text) && std::memcmp(r.str, text, r.len) == 0;
}

}  // namespace

// One connection: a hiredis context plus the endpoint's name for messages. Every failure of the link itself throws
// KVRET_ERR_IO; the tier then drops the connection and connects again on its next call.
struct RedisTier::Connection {
  redisContext* ctx = nullptr;
  std::string where;
  int timeout_ms = 0;

  ~Connection() {
    if (ctx != nullptr) redisFree(ctx);
  }

  [[noreturn]] void link_failed(const char* doing) const {
    std::string why = ctx != nullptr && ctx->err != 0 ? ctx->errstr : "no reply";
    if (ctx != nullptr && ctx->err == REDIS_ERR_IO &&
        (why.find("temporarily unavailable") != std::string::npos || why.find("timed out") != std::string::npos))
      why = "timed out after " + std::to_string(timeout_ms) + " ms";
    if (ctx != nullptr && ctx->err == REDIS_ERR_EOF) why = "the server closed the connection";
    throw Error(KVRET_ERR_IO, "shared session tier " + where + ": " + doing + ": " + why);
  }

  void append(std::initializer_list<std::string_view> args) {
    const char* argv[16];
    size_t argl[16];
    int n = 0;
    for (const std::string_view a : args) {
      argv[n] = a.data();
      argl[n] = a.size();
      ++n;
    }
    if (redisAppendCommandArgv(ctx, n, argv, argl) != REDIS_OK) link_failed("sending a command");
  }

  [[noreturn]] void timed_out(const char* doing) const {
    throw Error(KVRET_ERR_IO, "shared session tier " + where + ": " + doing + ": timed out after " +
                                  std::to_string(timeout_ms) + " ms (the whole reply)");
  }

  // Milliseconds left until `deadline` (at least 1); past it, the call has timed out.
  int left_ms(Clock::time_point deadline, const char* doing) const {
    const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) timed_out(doing);
    return static_cast<int>(std::min<int64_t>(left, timeout_ms));
  }

  // The next reply, whole within timeout_ms of asking for it (a server that trickles its bytes does not extend it),
  // and at most `limit` bytes long: a longer one is refused as it arrives (`too_long`: KVRET_ERR_CORRUPT for the
  // tier's own values, whose sizes are known, KVRET_ERR_IO for anything else). hiredis's blocking read would apply
  // the timeout to each read(2) and buffer a reply of any length; this loop reads through its reader instead.
  Reply reply(const char* doing, size_t limit = kSmallReply, kvret_status too_long = KVRET_ERR_IO) {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    size_t received = 0;
    bool sent = false;
    for (;;) {
      void* raw = nullptr;
      t_refused_elements = 0;
      if (redisGetReplyFromReader(ctx, &raw) != REDIS_OK) {
        if (t_refused_elements != 0)
          throw Error(too_long, "shared session tier " + where + ": " + doing + ": a reply of " +
                                    std::to_string(t_refused_elements) + " elements, more than the " +
                                    std::to_string(kMaxReplyElements) + " it can have");
        link_failed(doing);
      }
      if (raw != nullptr) return Reply(static_cast<redisReply*>(raw));
      if (!sent) {  // the commands appended since the last reply; a blocking write bounded by the time left
        int done = 0;
        while (done == 0) {
          const int ms = left_ms(deadline, doing);
          const timeval tv{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>((ms % 1000) * 1000)};
          if (::setsockopt(ctx->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
            throw Error(KVRET_ERR_IO, "shared session tier " + where + ": " + doing + ": " + std::strerror(errno));
          if (redisBufferWrite(ctx, &done) != REDIS_OK) link_failed(doing);
        }
        sent = true;
      }
      pollfd p{ctx->fd, POLLIN, 0};
      int rc = 0;
      do {
        rc = ::poll(&p, 1, left_ms(deadline, doing));
      } while (rc < 0 && errno == EINTR);
      if (rc < 0)
        throw Error(KVRET_ERR_IO, "shared session tier " + where + ": " + doing + ": " + std::strerror(errno));
      if (rc == 0) timed_out(doing);
      const size_t before = ctx->reader->len;
      if (redisBufferRead(ctx) != REDIS_OK) link_failed(doing);
      received += ctx->reader->len - before;
      if (received > limit + kReadSlack)
        throw Error(too_long, "shared session tier " + where + ": " + doing + ": the reply is longer than the " +
                                  std::to_string(limit) + " bytes it can have");
    }
  }

  Reply command(std::initializer_list<std::string_view> args, const char* doing, size_t limit = kSmallReply,
                kvret_status too_long = KVRET_ERR_IO) {
    append(args);
    return reply(doing, limit, too_long);
  }

  // A reply of the server that is an error: KVRET_ERR_CAPACITY when it is out of memory, else KVRET_ERR_IO.
  [[noreturn]] void server_error(const redisReply& r, const char* doing) const {
    const std::string text = r.type == REDIS_REPLY_ERROR ? std::string(r.str, r.len) : "an unexpected reply";
    const kvret_status status = text.rfind("OOM", 0) == 0 ? KVRET_ERR_CAPACITY : KVRET_ERR_IO;
    throw Error(status, "shared session tier " + where + ": " + doing + ": " + text);
  }
};

RedisTier::RedisTier(RedisEndpoint endpoint, size_t chunk_bytes, int64_t replace_grace_ms)
    : endpoint_(std::move(endpoint)), chunk_bytes_(chunk_bytes), replace_grace_ms_(replace_grace_ms) {
  require(!endpoint_.tls, KVRET_ERR_UNSUPPORTED,
          "session_shared_url: rediss:// (TLS) is not supported: this build's hiredis has no TLS; use redis:// on a "
          "trusted network or a TLS tunnel");
  require(chunk_bytes_ > 0 && chunk_bytes_ <= kMaxChunkBytes, KVRET_ERR_INVALID_ARGUMENT,
          "redis tier: chunk_bytes must be in 1..512 MiB");
  require(replace_grace_ms_ >= 0, KVRET_ERR_INVALID_ARGUMENT, "redis tier: replace_grace_ms must be >= 0");
  require(!endpoint_.host.empty() && endpoint_.port > 0 && endpoint_.port < 65536 && endpoint_.timeout_ms > 0,
          KVRET_ERR_INVALID_ARGUMENT, "redis tier: an endpoint needs a host, a port and a timeout");
  require(!endpoint_.prefix.empty() && endpoint_.prefix.find('\0') == std::string::npos, KVRET_ERR_INVALID_ARGUMENT,
          "redis tier: the key prefix must be non-empty, without NUL");
  reseed();
}

void RedisTier::reseed() {
  std::random_device rd;
  rng_.seed((uint64_t{rd()} << 32) ^ rd() ^
            static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  rng_pid_ = ::getpid();
}

RedisTier::~RedisTier() = default;

void RedisTier::drop_connection() noexcept { conn_.reset(); }

RedisTier::Connection& RedisTier::connection() {
  // a child of fork() shares its parent's socket: it closes its own copy (the parent's connection stays) and connects
  // anew
  if (conn_ && conn_pid_ != ::getpid()) conn_.reset();
  if (conn_) return *conn_;
  auto c = std::make_unique<Connection>();
  c->where = endpoint_.describe();
  c->timeout_ms = endpoint_.timeout_ms;
  const timeval tv{static_cast<time_t>(endpoint_.timeout_ms / 1000),
                   static_cast<suseconds_t>((endpoint_.timeout_ms % 1000) * 1000)};
  c->ctx = redisConnectWithTimeout(endpoint_.host.c_str(), endpoint_.port, tv);
  if (c->ctx == nullptr) throw Error(KVRET_ERR_OUT_OF_MEMORY, "shared session tier: no memory for a connection");
  if (c->ctx->err != 0) c->link_failed("cannot connect");
  if (redisSetTimeout(c->ctx, tv) != REDIS_OK) c->link_failed("setting the timeout");
  bound_reader(c->ctx->reader);
  if (!endpoint_.password.empty()) {
    const Reply r = endpoint_.username.empty()
                        ? c->command({"AUTH", endpoint_.password}, "authenticating")
                        : c->command({"AUTH", endpoint_.username, endpoint_.password}, "authenticating");
    if (r->type == REDIS_REPLY_ERROR)
      throw Error(KVRET_ERR_IO, "shared session tier " + c->where +
                                    ": the server refused the password: " + std::string(r->str, r->len));
  }
  if (endpoint_.db != 0) {
    const std::string db = std::to_string(endpoint_.db);
    const Reply r = c->command({"SELECT", db}, "selecting the database");
    if (!is_status(*r, "OK")) c->server_error(*r, "selecting the database");
  }
  conn_ = std::move(c);
  conn_pid_ = ::getpid();
  return *conn_;
}

void RedisTier::ping() {
  const SigpipeBlock sigpipe;
  const std::lock_guard lock(mutex_);
  try {
    Connection& c = connection();
    const Reply r = c.command({"PING"}, "PING");
    if (!is_status(*r, "PONG")) c.server_error(*r, "PING");
  } catch (...) {
    drop_connection();
    throw;
  }
}

namespace {

void check_key(const std::string& key) {
  require(!key.empty() && key.find('\0') == std::string::npos, KVRET_ERR_INVALID_ARGUMENT,
          "redis tier: a blob key must be non-empty and without NUL");
}

}  // namespace

void RedisTier::put(const std::string& key, const std::byte* data, size_t size, int64_t ttl_ms) {
  check_key(key);
  require(ttl_ms >= 0, KVRET_ERR_INVALID_ARGUMENT, "redis tier: ttl_ms must be >= 0");
  require(data != nullptr || size == 0, KVRET_ERR_INVALID_ARGUMENT, "redis tier: no data");
  const SigpipeBlock sigpipe;
  const std::lock_guard lock(mutex_);
  try {
    Connection& c = connection();
    const auto start = std::chrono::steady_clock::now();
    if (rng_pid_ != ::getpid()) reseed();  // a forked child must not draw its parent's versions
    Head head;
    head.version = rng_();
    head.size = size;
    head.chunk_bytes = chunk_bytes_;
    const size_t n = (size + chunk_bytes_ - 1) / chunk_bytes_;
    require(n <= (kMaxHeadBytes - 44) / 4, KVRET_ERR_CAPACITY,
            "redis tier: a blob of " + std::to_string(size) + " bytes needs more than " +
                std::to_string((kMaxHeadBytes - 44) / 4) + " chunks of " + std::to_string(chunk_bytes_) + " bytes");
    head.crcs.resize(n);
    std::vector<std::string> keys(n);
    const std::string chunk_px = std::to_string(ttl_ms > 0 ? ttl_ms : kOrphanGuardMs);

    // the chunks, pipelined; a failed chunk is reported after every reply is in (the connection stays in step)
    const size_t window = std::max<size_t>(1, kPipelineBytes / chunk_bytes_);
    size_t sent = 0;
    size_t answered = 0;
    std::optional<Error> failure;
    const auto take_reply = [&] {
      const Reply r = c.reply("writing a chunk");
      ++answered;
      if (!failure && !is_status(*r, "OK")) {
        try {
          c.server_error(*r, "writing a chunk");
        } catch (const Error& e) {
          failure = e;
        }
      }
    };
    for (size_t i = 0; i < n; ++i) {
      const size_t off = i * chunk_bytes_;
      const size_t len = std::min(chunk_bytes_, size - off);
      const char* bytes = reinterpret_cast<const char*>(data) + off;
      head.crcs[i] = crc32_of(bytes, len);
      keys[i] = chunk_key(key, head.version, i);
      c.append({"SET", keys[i], std::string_view(bytes, len), "PX", chunk_px});
      ++sent;
      if (sent - answered >= window) take_reply();
    }
    while (answered < sent) take_reply();
    if (failure) {
      // best effort: free what was written (it would expire anyway)
      try {
        for (const std::string& k : keys) c.append({"UNLINK", k});
        for (size_t i = 0; i < n; ++i) c.reply("removing a failed put's chunks");
      } catch (...) {
        drop_connection();
      }
      throw *failure;
    }

    const int64_t elapsed_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (ttl_ms == 0)
      require(elapsed_ms < kOrphanGuardMs / 2, KVRET_ERR_IO,
              "shared session tier " + c.where + ": writing the chunks took too long (" + std::to_string(elapsed_ms) +
                  " ms)");

    // the commit: the head replaces the old one in one transaction, the chunks of a blob without TTL made permanent
    // in the same one; with a TTL the head expires when the first chunk does (the blob's time runs from the put)
    const std::string value = encode_head(head);
    const std::string hkey = head_key(key);
    c.append({"MULTI"});
    if (ttl_ms == 0) {
      for (const std::string& k : keys) c.append({"PERSIST", k});
      c.append({"SET", hkey, value, "GET"});
    } else {
      c.append({"SET", hkey, value, "PX", std::to_string(std::max<int64_t>(1, ttl_ms - elapsed_ms)), "GET"});
    }
    c.append({"EXEC"});
    const Reply multi = c.reply("starting the commit");
    std::optional<Error> queue_failure;
    const size_t queued = ttl_ms == 0 ? n + 1 : 1;
    for (size_t i = 0; i < queued; ++i) {
      const Reply r = c.reply("queueing the commit");
      if (!queue_failure && !is_status(*r, "QUEUED")) {
        try {
          c.server_error(*r, "queueing the commit");
        } catch (const Error& e) {
          queue_failure = e;
        }
      }
    }
    // EXEC: an integer per PERSIST and the replaced head
    const Reply exec = c.reply("committing the head", kMaxHeadBytes + kBulkFraming * (queued + 2));
    if (!is_status(*multi, "OK")) c.server_error(*multi, "starting the commit");
    if (queue_failure) throw *queue_failure;
    if (exec->type != REDIS_REPLY_ARRAY || exec->elements != queued) c.server_error(*exec, "committing the head");
    const redisReply& old = *exec->element[queued - 1];
    if (old.type == REDIS_REPLY_ERROR) c.server_error(old, "committing the head");
    if (ttl_ms == 0)
      for (size_t i = 0; i + 1 < queued; ++i)
        if (exec->element[i]->type != REDIS_REPLY_INTEGER || exec->element[i]->integer != 1)
          throw Error(KVRET_ERR_IO, "shared session tier " + c.where +
                                        ": a chunk expired or was evicted before the head was written");

    // committed: the old version's chunks go after a grace (readers that read the old head still find them)
    if (old.type != REDIS_REPLY_STRING) return;
    const std::optional<Head> previous = decode_head(old.str, old.len);
    if (!previous || previous->version == head.version) return;
    try {
      const std::string grace = std::to_string(replace_grace_ms_);
      for (size_t i = 0; i < previous->crcs.size(); ++i) {
        const std::string k = chunk_key(key, previous->version, i);
        if (replace_grace_ms_ > 0)
          c.append({"PEXPIRE", k, grace});
        else
          c.append({"UNLINK", k});
      }
      for (size_t i = 0; i < previous->crcs.size(); ++i) c.reply("retiring the old chunks");
    } catch (...) {
      drop_connection();  // the put itself succeeded; the old chunks keep the expiry they had
    }
  } catch (...) {
    drop_connection();
    throw;
  }
}

std::optional<std::vector<std::byte>> RedisTier::get_once(Connection& c, const std::string& key, bool& retry) {
  retry = false;
  const std::string hkey = head_key(key);
  const auto read_head = [&]() -> std::optional<Head> {
    const Reply r = c.command({"GET", hkey}, "reading the head", kMaxHeadBytes + kBulkFraming, KVRET_ERR_CORRUPT);
    if (r->type == REDIS_REPLY_NIL) return std::nullopt;
    if (r->type != REDIS_REPLY_STRING) c.server_error(*r, "reading the head");
    std::optional<Head> h = decode_head(r->str, r->len);
    if (!h) throw Error(KVRET_ERR_CORRUPT, "shared session tier " + c.where + ": the head of '" + key + "' is corrupt");
    return h;
  };
  const std::optional<Head> head = read_head();
  if (!head) return std::nullopt;
  const size_t n = head->crcs.size();
  // filled as the chunks arrive: a damaged head that claims a huge size costs nothing until its bytes come
  std::vector<std::byte> out;
  out.reserve(static_cast<size_t>(std::min<uint64_t>(head->size, kPipelineBytes)));
  const size_t window = std::max<size_t>(1, kPipelineBytes / head->chunk_bytes);
  size_t sent = 0;
  size_t answered = 0;
  bool missing = false;
  std::optional<Error> corrupt;
  const auto take_reply = [&] {
    const size_t i = answered++;
    const Reply r = c.reply("reading a chunk", head->chunk_size(i) + kBulkFraming, KVRET_ERR_CORRUPT);
    if (r->type == REDIS_REPLY_NIL) {
      missing = true;
      return;
    }
    if (r->type != REDIS_REPLY_STRING) c.server_error(*r, "reading a chunk");
    if (corrupt) return;
    if (r->len != head->chunk_size(i) || crc32_of(r->str, r->len) != head->crcs[i]) {
      corrupt =
          Error(KVRET_ERR_CORRUPT, "shared session tier " + c.where + ": chunk " + std::to_string(i) + " of '" + key +
                                       "' fails its " + (r->len != head->chunk_size(i) ? "size" : "checksum"));
      return;
    }
    if (!missing)
      out.insert(out.end(), reinterpret_cast<const std::byte*>(r->str),
                 reinterpret_cast<const std::byte*>(r->str) + r->len);
  };
  for (size_t i = 0; i < n; ++i) {
    c.append({"GET", chunk_key(key, head->version, i)});
    ++sent;
    if (sent - answered >= window) take_reply();
  }
  while (answered < sent) take_reply();
  if (corrupt) throw *corrupt;
  if (!missing) return out;
  // a chunk is gone: replaced meanwhile (read again), or expired / evicted with its head still there (a miss)
  const std::optional<Head> now = read_head();
  retry = now && now->version != head->version;
  return std::nullopt;
}

std::optional<std::vector<std::byte>> RedisTier::get(const std::string& key) {
  check_key(key);
  const SigpipeBlock sigpipe;
  const std::lock_guard lock(mutex_);
  try {
    Connection& c = connection();
    for (int attempt = 0; attempt < kReadAttempts; ++attempt) {
      bool retry = false;
      std::optional<std::vector<std::byte>> out = get_once(c, key, retry);
      if (!retry) return out;
    }
    return std::nullopt;  // replaced faster than it could be read, every time
  } catch (...) {
    drop_connection();
    throw;
  }
}

bool RedisTier::remove(const std::string& key) {
  check_key(key);
  const SigpipeBlock sigpipe;
  const std::lock_guard lock(mutex_);
  try {
    Connection& c = connection();
    const Reply r = c.command({"GETDEL", head_key(key)}, "removing the head", kMaxHeadBytes + kBulkFraming);
    if (r->type == REDIS_REPLY_NIL) return false;
    if (r->type != REDIS_REPLY_STRING) c.server_error(*r, "removing the head");
    if (const std::optional<Head> h = decode_head(r->str, r->len)) {
      for (size_t i = 0; i < h->crcs.size(); ++i) c.append({"UNLINK", chunk_key(key, h->version, i)});
      for (size_t i = 0; i < h->crcs.size(); ++i) c.reply("removing the chunks");
    }
    return true;
  } catch (...) {
    drop_connection();
    throw;
  }
}

#else  // no hiredis: the URL still parses, the tier refuses to be built

bool redis_tier_available() noexcept { return false; }

struct RedisTier::Connection {};

namespace {
[[noreturn]] void no_redis() {
  throw Error(KVRET_ERR_UNSUPPORTED,
              "session_shared_url: this build of kvret has no Redis tier (it was built without hiredis)");
}
}  // namespace

RedisTier::RedisTier(RedisEndpoint endpoint, size_t chunk_bytes, int64_t replace_grace_ms)
    : endpoint_(std::move(endpoint)), chunk_bytes_(chunk_bytes), replace_grace_ms_(replace_grace_ms) {
  no_redis();
}
RedisTier::~RedisTier() = default;
void RedisTier::reseed() {}
void RedisTier::drop_connection() noexcept {}
RedisTier::Connection& RedisTier::connection() { no_redis(); }
void RedisTier::ping() { no_redis(); }
void RedisTier::put(const std::string&, const std::byte*, size_t, int64_t) { no_redis(); }
std::optional<std::vector<std::byte>> RedisTier::get(const std::string&) { no_redis(); }
bool RedisTier::remove(const std::string&) { no_redis(); }
std::optional<std::vector<std::byte>> RedisTier::get_once(Connection&, const std::string&, bool&) { no_redis(); }

#endif

}  // namespace kvret::session
