#pragma once
// Binding a caller's library handle (cuBLAS) to a stream and pointer mode for the duration of one launcher call,
// and giving it back as it was on every exit path. Generic over the library, so the host tests check it with a
// fake handle; launch_kmeans uses it with cuBLAS (pq_kmeans.cu).
namespace kvret::cuda::math {

/// Api provides the types Handle, Stream, Mode and Status, the constant kSuccess, and the static functions
/// get_stream(Handle, Stream*), set_stream(Handle, Stream), get_mode(Handle, Mode*), set_mode(Handle, Mode),
/// each returning a Status.
template <class Api>
class ScopedHandleBinding {
 public:
  using Handle = typename Api::Handle;
  using Stream = typename Api::Stream;
  using Mode = typename Api::Mode;
  using Status = typename Api::Status;

  explicit ScopedHandleBinding(Handle handle) : handle_(handle) {}
  ScopedHandleBinding(const ScopedHandleBinding&) = delete;
  ScopedHandleBinding& operator=(const ScopedHandleBinding&) = delete;
  ~ScopedHandleBinding() { (void)restore(); }

  /// Saves the handle's stream and pointer mode, then sets `stream` and `mode`. On a failure, whatever was
  /// changed is already restored when this returns.
  Status bind(Stream stream, Mode mode) {
    Status s = Api::get_stream(handle_, &saved_stream_);
    if (s != Api::kSuccess) return s;
    if ((s = Api::get_mode(handle_, &saved_mode_)) != Api::kSuccess) return s;
    if ((s = Api::set_stream(handle_, stream)) != Api::kSuccess) return s;
    stream_set_ = true;
    if ((s = Api::set_mode(handle_, mode)) != Api::kSuccess) {
      (void)restore();
      return s;
    }
    mode_set_ = true;
    return s;
  }

  /// Gives the handle its saved stream and pointer mode back (once; the destructor calls it too).
  Status restore() {
    Status result = Api::kSuccess;
    if (mode_set_) {
      mode_set_ = false;
      const Status s = Api::set_mode(handle_, saved_mode_);
      if (s != Api::kSuccess) result = s;
    }
    if (stream_set_) {
      stream_set_ = false;
      const Status s = Api::set_stream(handle_, saved_stream_);
      if (s != Api::kSuccess && result == Api::kSuccess) result = s;
    }
    return result;
  }

 private:
  Handle handle_;
  Stream saved_stream_{};
  Mode saved_mode_{};
  bool stream_set_ = false;
  bool mode_set_ = false;
};

}  // namespace kvret::cuda::math
