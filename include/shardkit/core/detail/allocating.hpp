#pragma once
//! An allocation that says what it was for: a model, loader or buffer too large for the machine fails with
//! errc::out_of_memory naming the buffer and its size, not a bare std::bad_alloc (or an arena's "mmap of N bytes
//! failed" with no word of what the N bytes were).
#include <cstddef>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "shardkit/core/error.hpp"

namespace shardkit::detail {

//! The product of `factors`, plus `extra`: the size of an allocation computed from a count (a caller's
//! buffer_view holds up to max_count elements, PTRDIFF_MAX bytes) times an element size and a number of slots or
//! ranks. nullopt where it is more than std::size_t holds: wrapped around, it would be a small allocation that the
//! caller then writes its full size into.
inline std::optional<std::size_t> checked_size(std::initializer_list<std::size_t> factors, std::size_t extra = 0) noexcept {
  std::size_t size = 1;
  for (const std::size_t f : factors)
    if (__builtin_mul_overflow(size, f, &size)) return std::nullopt;
  if (__builtin_add_overflow(size, extra, &size)) return std::nullopt;
  return size;
}

[[noreturn]] inline void allocation_failed(std::string_view what, std::size_t bytes, const error_context& where,
                                           std::string_view why) {
  throw_error(errc::out_of_memory, "allocating " + std::string(what) + " (" + std::to_string(bytes) + " bytes): " + std::string(why),
              where);
}

//! Returns allocate(), an allocation of `bytes` for `what`; its failure to allocate (std::bad_alloc, or an error
//! with errc::out_of_memory) is thrown as errc::out_of_memory: "allocating WHAT (N bytes): why", with `where`.
template <class F>
decltype(auto) allocating(std::string_view what, std::size_t bytes, const error_context& where, F&& allocate) {
  try {
    return std::forward<F>(allocate)();
  } catch (const std::bad_alloc&) {
    allocation_failed(what, bytes, where, "the system has not that much memory");
  } catch (const error& e) {
    if (e.code() != errc::out_of_memory) throw;
    allocation_failed(what, bytes, where, e.detail());
  }
}

}  // namespace shardkit::detail
