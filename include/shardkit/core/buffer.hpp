#pragma once
//! Non-owning views of the trainer's memory: pointer, element count, dtype and the device it lives on.
//!
//! shardkit never owns the trainer's tensors; collectives take these views and write results into them.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit {

namespace detail {
//! Out of line so that slice() stays small enough to inline.
[[noreturn, gnu::cold, gnu::noinline]] inline void throw_bad_slice(std::size_t offset, std::size_t n, std::size_t count,
                                                                  dtype type) {
  throw_error(errc::invalid_argument, "slice of " + std::to_string(n) + " elements at offset " + std::to_string(offset) +
                                          " runs past the end of a view of " + std::to_string(count) + " " +
                                          std::string(to_string(type)) + " elements",
              {.operation = "buffer_view.slice"});
}
}  // namespace detail

//! The most elements of `type` that one view may hold: their bytes must fit in a std::ptrdiff_t, as any object's
//! do (pointer arithmetic across more is undefined), so that count * size_of(type) never wraps around. A span of
//! 2^62 + 1 floats is a view the type system accepts, but its size_bytes() would read 4.
constexpr std::size_t max_count(dtype type) noexcept { return std::size_t(PTRDIFF_MAX) / size_of(type); }

enum class device_kind : std::uint8_t { host, cuda };

struct device {
  device_kind kind = device_kind::host;
  int index = 0;  //!< CUDA ordinal; 0 for host
  static constexpr device host() noexcept { return {}; }
  static constexpr device cuda(int ordinal) noexcept { return {device_kind::cuda, ordinal}; }
  friend constexpr bool operator==(device, device) = default;
};

inline std::string to_string(device d) {
  return d.kind == device_kind::host ? std::string("host") : "cuda:" + std::to_string(d.index);
}

template <bool Mutable>
class basic_buffer_view {
 public:
  using pointer = std::conditional_t<Mutable, std::byte*, const std::byte*>;
  using void_pointer = std::conditional_t<Mutable, void*, const void*>;

  constexpr basic_buffer_view() = default;
  constexpr basic_buffer_view(void_pointer data, std::size_t count, dtype type, device dev = {}) noexcept
      : data_(static_cast<pointer>(data)), count_(count), type_(type), device_(dev) {}

  //! From a span of a supported element type: dtype is deduced.
  template <element_type T>
    requires(Mutable ? !std::is_const_v<T> : true)
  constexpr basic_buffer_view(std::span<T> s, device dev = {}) noexcept  // NOLINT: implicit on purpose
      : basic_buffer_view(s.data(), s.size(), dtype_v<T>, dev) {}

  //! A mutable view converts to a const one.
  template <bool M = Mutable>
    requires(!M)
  constexpr basic_buffer_view(const basic_buffer_view<true>& other) noexcept  // NOLINT
      : basic_buffer_view(other.data(), other.count(), other.type(), other.dev()) {}

  constexpr pointer data() const noexcept { return data_; }
  constexpr std::size_t count() const noexcept { return count_; }
  constexpr dtype type() const noexcept { return type_; }
  constexpr device dev() const noexcept { return device_; }
  constexpr std::size_t element_size() const noexcept { return size_of(type_); }
  constexpr std::size_t size_bytes() const noexcept { return count_ * size_of(type_); }
  //! count() is at most max_count(type()): size_bytes() is exact. No memory holds a view where it is not, so
  //! process_group refuses one at the call (errc::invalid_argument naming the call and the count).
  constexpr bool size_fits() const noexcept { return count_ <= max_count(type_); }
  constexpr bool empty() const noexcept { return count_ == 0; }

  //! Elements [offset, offset + n); errc::invalid_argument naming offset, n and count() when that runs past the
  //! end. Checked always, not only in debug builds: no algorithm slices per chunk (they step raw pointers), slice
  //! runs a few times per collective in process_group's argument checks, where two compares cost nothing
  //! measurable next to the call, and a view past its buffer would be read and written by peers too.
  constexpr basic_buffer_view slice(std::size_t offset, std::size_t n) const {
    if (offset > count_ || n > count_ - offset) detail::throw_bad_slice(offset, n, count_, type_);
    return {data_ + offset * element_size(), n, type_, device_};
  }
  std::span<std::conditional_t<Mutable, std::byte, const std::byte>> bytes() const noexcept {
    return {data_, size_bytes()};
  }
  template <element_type T>
  std::span<std::conditional_t<Mutable, T, const T>> as() const noexcept {
    return {reinterpret_cast<std::conditional_t<Mutable, T, const T>*>(data_), count_};
  }

 private:
  pointer data_ = nullptr;
  std::size_t count_ = 0;
  dtype type_ = dtype::u8;
  device device_{};
};

using buffer_view = basic_buffer_view<true>;
using const_buffer_view = basic_buffer_view<false>;

template <element_type T>
basic_buffer_view(std::span<T>) -> basic_buffer_view<!std::is_const_v<T>>;

//! True when the byte ranges overlap (used to detect in-place calls and aliasing mistakes).
inline bool overlaps(const_buffer_view a, const_buffer_view b) noexcept {
  if (a.size_bytes() == 0 || b.size_bytes() == 0) return false;
  return a.data() < b.data() + b.size_bytes() && b.data() < a.data() + a.size_bytes();
}

}  // namespace shardkit
