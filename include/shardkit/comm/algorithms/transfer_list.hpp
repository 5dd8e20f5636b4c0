#pragma once
//! transfer_list: what one collective posted (its recvs' completions, its sends' with their peers), in the order
//! posted. The first N live inside the list, so a small collective allocates nothing for them (an 8-byte
//! all_reduce on 2 ranks posts one recv and one send: three vectors cost it three mallocs and frees per call,
//! docs/benchmarks.md); more go to a vector.
#include <algorithm>
#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace shardkit::comm::algorithms {

template <class V, std::size_t N>
class transfer_list {
 public:
  transfer_list() = default;
  transfer_list(const transfer_list&) = delete;
  transfer_list& operator=(const transfer_list&) = delete;
  ~transfer_list() { clear(); }

  std::size_t size() const noexcept { return size_; }
  //! The i-th posted (i < size()). A reference to one of the first N stays valid until clear(); one past them,
  //! until the next emplace_back.
  V& operator[](std::size_t i) noexcept { return i < N ? held(i) : more_[i - N]; }
  const V& operator[](std::size_t i) const noexcept { return i < N ? held(i) : more_[i - N]; }

  template <class... A>
  V& emplace_back(A&&... a) {
    if (size_ < N) {
      V* v = ::new (static_cast<void*>(slots_ + size_ * sizeof(V))) V(std::forward<A>(a)...);
      ++size_;
      return *v;
    }
    V& v = more_.emplace_back(std::forward<A>(a)...);
    ++size_;
    return v;
  }

  void clear() noexcept {
    for (std::size_t i = 0, n = std::min(size_, N); i < n; ++i) held(i).~V();
    more_.clear();
    size_ = 0;
  }

  template <class F>
  void for_each(F&& f) {
    for (std::size_t i = 0; i < size_; ++i) f((*this)[i]);
  }

 private:
  V& held(std::size_t i) noexcept { return *std::launder(reinterpret_cast<V*>(slots_ + i * sizeof(V))); }
  const V& held(std::size_t i) const noexcept {
    return *std::launder(reinterpret_cast<const V*>(slots_ + i * sizeof(V)));
  }

  alignas(V) std::byte slots_[N * sizeof(V)];
  std::size_t size_ = 0;
  std::vector<V> more_;
};

}  // namespace shardkit::comm::algorithms
