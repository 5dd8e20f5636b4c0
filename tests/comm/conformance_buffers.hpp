#pragma once
// Where the conformance suite's buffers live. Every buffer has a host image (typed_buffer) where values are set
// and checked; with a device buffer_factory it also has a device twin, and the suite copies the image in before
// an operation and out after it. The host default views the image itself, so host runs copy nothing.
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "shardkit/core/buffer.hpp"
#include "shardkit/core/dtype.hpp"

namespace shardkit::test {

namespace conformance_detail {

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) return T(float(v));
  else return T(v);
}
template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) return double(float(v));
  else return double(v);
}

// Host memory of one dtype, read and written as doubles (every value the suite uses is exact in every dtype).
struct typed_buffer {
  dtype type;
  std::vector<std::byte> bytes;
  typed_buffer(dtype t, std::size_t count) : type(t), bytes(count * size_of(t)) {}
  std::size_t count() const { return bytes.size() / size_of(type); }
  buffer_view view() { return {bytes.data(), count(), type}; }
  buffer_view view(std::size_t off, std::size_t n) { return view().slice(off, n); }
  void set(std::size_t i, double v) {
    visit_dtype(type, [&](auto tag) {
      using T = decltype(tag);
      reinterpret_cast<T*>(bytes.data())[i] = from_double<T>(v);
    });
  }
  double get(std::size_t i) const {
    return visit_dtype(type, [&](auto tag) {
      using T = decltype(tag);
      return to_double(reinterpret_cast<const T*>(bytes.data())[i]);
    });
  }
};

}  // namespace conformance_detail

//! How a device backend gives the suite its memory. Leave it default for host memory. Otherwise all three
//! functions are set:
//! 1. `allocate(bytes)` returns device memory of at least `bytes` bytes (also for 0) whose deleter frees it;
//! 2. `copy_in(device_dst, host_src, bytes)` and `copy_out(host_dst, device_src, bytes)` return when the copy is
//!    complete (the suite checks values right after `copy_out`);
//! 3. `where` is the device the views are tagged with.
struct buffer_factory {
  std::string name = "host";  // in the report: where the buffers lived
  device where = device::host();
  std::function<std::shared_ptr<std::byte>(std::size_t bytes)> allocate;
  std::function<void(std::byte* device_dst, const std::byte* host_src, std::size_t bytes)> copy_in;
  std::function<void(std::byte* host_dst, const std::byte* device_src, std::size_t bytes)> copy_out;

  bool on_host() const noexcept { return !allocate; }
};

//! One buffer of the suite: the host image, and the device twin a device factory allocates.
class test_buffer {
 public:
  test_buffer(const buffer_factory& f, dtype t, std::size_t count) : factory_(&f), host_(t, count) {
    if (!f.on_host()) device_ = f.allocate(host_.bytes.size());
  }
  test_buffer(const test_buffer&) = delete;  // a copy would share the device twin
  test_buffer& operator=(const test_buffer&) = delete;
  test_buffer(test_buffer&&) = default;
  test_buffer& operator=(test_buffer&&) = default;

  conformance_detail::typed_buffer& host() noexcept { return host_; }
  const conformance_detail::typed_buffer& host() const noexcept { return host_; }
  dtype type() const noexcept { return host_.type; }
  std::size_t count() const noexcept { return host_.count(); }
  void set(std::size_t i, double v) { host_.set(i, v); }
  double get(std::size_t i) const { return host_.get(i); }

  //! Host image to the device (nothing to do on the host).
  test_buffer& copy_in() {
    if (device_) factory_->copy_in(device_.get(), host_.bytes.data(), host_.bytes.size());
    return *this;
  }
  //! Device to the host image, where the suite reads results.
  test_buffer& copy_out() {
    if (device_) factory_->copy_out(host_.bytes.data(), device_.get(), host_.bytes.size());
    return *this;
  }

  //! What the collectives get: the device twin, or the host image itself.
  buffer_view view() {
    return device_ ? buffer_view(device_.get(), host_.count(), host_.type, factory_->where) : host_.view();
  }
  buffer_view view(std::size_t offset, std::size_t n) { return view().slice(offset, n); }

 private:
  const buffer_factory* factory_;
  conformance_detail::typed_buffer host_;
  std::shared_ptr<std::byte> device_;
};

}  // namespace shardkit::test
