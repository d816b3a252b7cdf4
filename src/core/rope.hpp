#pragma once
// The rotary position embedding (RoPE) of key rows, for config.rope_keys = 1 (docs/rope.md). The math is inline and
// __host__ __device__ under nvcc, so that a CUDA kernel rotates exactly as the host does.
//
// Pair i of the `dims` rotated dimensions of a head (dimensions i and i + dims/2 in the NeoX layout, 2i and 2i + 1 in
// the GPT-J layout; dimensions from dims on pass unrotated) turns by the angle pos * inv_freq[i], where inv_freq[i] =
// theta^(-2i/dims), optionally rescaled as Llama 3 does:
//   (x, y) -> (x cos - y sin, x sin + y cos).
//
// Precision. inv_freq, the angle, its cosine and sine and the rotated elements are computed in double, and only the
// result is rounded to float: at position 100,000 the angle of the fastest pair is off by about 1e-11 rad (a float32
// angle, as many engines compute it, is off by up to 4e-3 rad there), and each output is within one float rounding
// (2^-24 relative) of the exact rotation of the float inputs. Nothing in between is rounded to float, so the result
// does not depend on when a compiler rounds intermediate floats (GCC's excess precision may skip such roundings):
// the rotation of a row is the same function of (row, position, parameters) in every translation unit built without
// contraction into fused multiply-adds (the default x86-64 target; -ffp-contract=off where FMA is enabled). On the
// device the products and sums use the non-contracting __dmul_rn / __dadd_rn, so a kernel given the host's inverse
// frequencies (Rope::inv_freq) and cosines and sines (Rope::cos_sin_at) rotates bit for bit as the host does; one
// computing them itself uses CUDA's pow/cos/sin, which may differ from the host's in the last bits of a double.
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define KVRET_ROPE_HD __host__ __device__
#else
#define KVRET_ROPE_HD
#endif

namespace kvret::rope {

/// How the rotated dimensions pair up (the values of kvret_rope_layout).
enum Layout : int32_t { kNeox = 0, kGptj = 1 };

/// Llama 3's frequency scaling (Hugging Face's rope_type "llama3"); factor 0: none.
struct Llama3Scaling {
  double factor = 0.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_positions = 8192.0;
};

/// The inverse frequency of pair i (0 <= i < dims/2): theta^(-2i/dims), then with Llama 3 scaling (factor > 0)
/// wavelengths 2*pi/f below original/high_freq_factor are kept, those above original/low_freq_factor divided by
/// factor, and those between blended: (1 - s) f/factor + s f with s = (original/wavelength - low) / (high - low).
KVRET_ROPE_HD inline double inv_frequency(int i, int dims, double theta, const Llama3Scaling& scaling) {
  const double f = 1.0 / pow(theta, (2.0 * i) / dims);
  if (scaling.factor <= 0.0) return f;
  const double pi = 3.141592653589793238462643383279502884;
  const double wavelength = 2.0 * pi / f;
  if (wavelength < scaling.original_max_positions / scaling.high_freq_factor) return f;
  if (wavelength > scaling.original_max_positions / scaling.low_freq_factor) return f / scaling.factor;
  const double s = (scaling.original_max_positions / wavelength - scaling.low_freq_factor) /
                   (scaling.high_freq_factor - scaling.low_freq_factor);
  return (1.0 - s) * f / scaling.factor + s * f;
}

/// The cosine and sine of pair i's angle at `pos`.
KVRET_ROPE_HD inline void cos_sin(int64_t pos, double inv_freq, double* c, double* s) {
  const double angle = static_cast<double>(pos) * inv_freq;
  *c = cos(angle);
  *s = sin(angle);
}

/// a * b and a + b, never contracted into a fused multiply-add on the device.
KVRET_ROPE_HD inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
KVRET_ROPE_HD inline double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

/// Turns the pair (x, y) by the angle of cosine c and sine s (see the precision note above).
KVRET_ROPE_HD inline void rotate_pair(float* x, float* y, double c, double s) {
  const double xd = *x, yd = *y;
  *x = static_cast<float>(add(mul(xd, c), -mul(yd, s)));
  *y = static_cast<float>(add(mul(xd, s), mul(yd, c)));
}

/// The two dimensions of pair i.
KVRET_ROPE_HD inline int pair_first(int i, int32_t layout) { return layout == kGptj ? 2 * i : i; }
KVRET_ROPE_HD inline int pair_second(int i, int dims, int32_t layout) {
  return layout == kGptj ? 2 * i + 1 : i + dims / 2;
}

/// Rotates a row in place with the cosines and sines of its position (dims/2 of each, from cos_sin).
KVRET_ROPE_HD inline void rotate_row(float* row, int dims, int32_t layout, const double* c, const double* s) {
  for (int i = 0; i < dims / 2; ++i)
    rotate_pair(row + pair_first(i, layout), row + pair_second(i, dims, layout), c[i], s[i]);
}

/// Rotates a row in place at `pos` with the inverse frequencies inv_freq[0 .. dims/2).
KVRET_ROPE_HD inline void rotate_row_at(float* row, int dims, int32_t layout, const double* inv_freq, int64_t pos) {
  for (int i = 0; i < dims / 2; ++i) {
    double c, s;
    cos_sin(pos, inv_freq[i], &c, &s);
    rotate_pair(row + pair_first(i, layout), row + pair_second(i, dims, layout), c, s);
  }
}

/// A head's rotary embedding, on the host: its rotated dimensions, layout and inverse frequencies.
class Rope {
 public:
  Rope(int dims, int32_t layout, double theta, const Llama3Scaling& scaling = {})
      : dims_(dims), layout_(layout), inv_freq_(static_cast<size_t>(dims / 2)) {
    for (int i = 0; i < dims / 2; ++i) inv_freq_[static_cast<size_t>(i)] = inv_frequency(i, dims, theta, scaling);
  }

  int dims() const noexcept { return dims_; }
  int pairs() const noexcept { return dims_ / 2; }
  int32_t layout() const noexcept { return layout_; }
  const double* inv_freq() const noexcept { return inv_freq_.data(); }

  /// The cosines and sines of every pair at `pos` into c[0 .. pairs()) and s[0 .. pairs()).
  void cos_sin_at(int64_t pos, double* c, double* s) const noexcept {
    for (int i = 0; i < pairs(); ++i) cos_sin(pos, inv_freq_[static_cast<size_t>(i)], c + i, s + i);
  }
  /// Rotates a row (of head_dim >= dims() elements) with cosines and sines from cos_sin_at.
  void rotate(float* row, const double* c, const double* s) const noexcept { rotate_row(row, dims_, layout_, c, s); }
  /// Rotates a row at `pos`.
  void rotate_at(float* row, int64_t pos) const noexcept { rotate_row_at(row, dims_, layout_, inv_freq(), pos); }

 private:
  int dims_;
  int32_t layout_;
  std::vector<double> inv_freq_;
};

}  // namespace kvret::rope
