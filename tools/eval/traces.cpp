#include "traces.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "core/half.hpp"

namespace kvret::eval {

namespace {

std::runtime_error failure(const std::string& path, const std::string& why) {
  return std::runtime_error(path + ": " + why);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw failure(path, "cannot open");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// The text after "key": in a flat JSON object (enough for meta.json).
std::string json_value(const std::string& json, const std::string& key, const std::string& path) {
  const std::string quoted = "\"" + key + "\"";
  size_t at = json.find(quoted);
  if (at == std::string::npos) throw failure(path, "no \"" + key + "\"");
  at = json.find(':', at + quoted.size());
  if (at == std::string::npos) throw failure(path, "malformed \"" + key + "\"");
  ++at;
  while (at < json.size() && std::isspace(static_cast<unsigned char>(json[at]))) ++at;
  size_t end = at;
  if (json[at] == '[') {
    end = json.find(']', at);
  } else if (json[at] == '"') {
    end = json.find('"', at + 1);
  } else {
    while (end < json.size() && json[end] != ',' && json[end] != '}' && json[end] != '\n') ++end;
    --end;
  }
  if (end == std::string::npos) throw failure(path, "malformed \"" + key + "\"");
  return json.substr(at, end - at + 1);
}

std::vector<int> int_list(const std::string& s) {
  std::vector<int> out;
  for (size_t i = 0; i < s.size();) {
    if (std::isdigit(static_cast<unsigned char>(s[i]))) {
      size_t n = 0;
      out.push_back(std::stoi(s.substr(i), &n));
      i += n;
    } else {
      ++i;
    }
  }
  return out;
}

std::string layer_file(const std::string& dir, const char* name, int layer) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "/%s.%02d.npy", name, layer);
  return dir + buf;
}

/// [T, H, D] -> [T, H, padded] with zeros, times `factor`.
std::vector<float> pad(const NpyArray& a, int heads, int dim, int padded, float factor, const std::string& path) {
  if (a.shape.size() != 3 || a.shape[1] != heads || a.shape[2] != dim)
    throw failure(path, "shape does not match meta.json");
  const int64_t rows = a.shape[0] * heads;
  std::vector<float> out(static_cast<size_t>(rows) * padded, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < dim; ++i)
      out[static_cast<size_t>(r * padded + i)] = factor * a.data[static_cast<size_t>(r * dim + i)];
  return out;
}

}  // namespace

NpyArray load_npy(const std::string& path) {
  const std::string bytes = read_file(path);
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) throw failure(path, "not a .npy file");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len =
        static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
    offset = 10;
  } else {
    if (bytes.size() < 12) throw failure(path, "truncated header");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    offset = 12;
  }
  if (bytes.size() < offset + header_len) throw failure(path, "truncated header");
  const std::string header = bytes.substr(offset, header_len);
  offset += header_len;
  if (header.find("'fortran_order': False") == std::string::npos) throw failure(path, "Fortran order is not supported");
  int width = 0;
  if (header.find("'<f2'") != std::string::npos) width = 2;
  if (header.find("'<f4'") != std::string::npos) width = 4;
  if (width == 0) throw failure(path, "dtype must be little-endian float16 or float32");
  const size_t s0 = header.find("'shape': (");
  if (s0 == std::string::npos) throw failure(path, "no shape");
  const size_t s1 = header.find(')', s0);
  NpyArray a;
  for (int d : int_list(header.substr(s0 + 10, s1 - s0 - 10))) a.shape.push_back(d);
  int64_t n = 1;
  for (int64_t d : a.shape) n *= d;
  if (bytes.size() < offset + static_cast<size_t>(n) * width) throw failure(path, "truncated data");
  a.data.resize(static_cast<size_t>(n));
  const char* p = bytes.data() + offset;
  if (width == 4) {
    std::memcpy(a.data.data(), p, static_cast<size_t>(n) * 4);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      a.data[static_cast<size_t>(i)] = f16_to_f32(h);
    }
  }
  return a;
}

Trace::Trace(std::string dir) : dir_(std::move(dir)) {
  const std::string path = dir_ + "/meta.json";
  const std::string json = read_file(path);
  const std::string model = json_value(json, "model", path);
  meta_.model = model.size() >= 2 ? model.substr(1, model.size() - 2) : model;
  meta_.n_q_heads = std::stoi(json_value(json, "n_q_heads", path));
  meta_.n_kv_heads = std::stoi(json_value(json, "n_kv_heads", path));
  meta_.head_dim = std::stoi(json_value(json, "head_dim", path));
  meta_.tokens = std::stoll(json_value(json, "tokens", path));
  meta_.layers = int_list(json_value(json, "layers", path));
  meta_.pre_rope = json_value(json, "pre_rope", path) == "true";
  if (meta_.pre_rope) {
    meta_.rope_theta = std::stod(json_value(json, "rope_theta", path));
    meta_.rope_adjacent_pairs = json_value(json, "rope_layout", path).find("adjacent pairs") != std::string::npos;
  }
  if (meta_.n_q_heads <= 0 || meta_.n_kv_heads <= 0 || meta_.n_q_heads % meta_.n_kv_heads != 0 || meta_.head_dim <= 0 ||
      meta_.head_dim > 256 || meta_.tokens <= 0 || meta_.layers.empty())
    throw failure(path, "implausible geometry");
}

int Trace::padded_dim() const noexcept {
  for (int d : {64, 128, 256})
    if (meta_.head_dim <= d) return d;
  return 256;
}

TraceLayer Trace::layer(int layer, bool with_pre_rope) const {
  TraceLayer t;
  t.padded_dim = padded_dim();
  const int d = meta_.head_dim, p = t.padded_dim;
  const float q_factor = std::sqrt(static_cast<float>(p) / static_cast<float>(d));
  auto load = [&](const char* name, int heads, float factor) {
    const std::string path = layer_file(dir_, name, layer);
    return pad(load_npy(path), heads, d, p, factor, path);
  };
  t.q = load("q", meta_.n_q_heads, q_factor);
  t.k = load("k", meta_.n_kv_heads, 1.0f);
  t.v = load("v", meta_.n_kv_heads, 1.0f);
  if (with_pre_rope) {
    if (!meta_.pre_rope) throw failure(dir_, "the trace has no pre-RoPE queries/keys (make_traces.py --pre-rope)");
    t.q_pre = load("q_pre", meta_.n_q_heads, q_factor);
    t.k_pre = load("k_pre", meta_.n_kv_heads, 1.0f);
  }
  return t;
}

}  // namespace kvret::eval
