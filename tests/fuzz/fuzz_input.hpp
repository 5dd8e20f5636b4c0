#pragma once
// What every fuzz target shares: the libFuzzer entry point's declaration and a cursor over the input that
// hands out fixed-width fields (zero once the input runs out), so a target can take a few parameters from the
// front of its input and use the rest as the bytes under test.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <span>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace shardkit::fuzz {

class input {
 public:
  input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  template <class T>
  T take() {
    T v{};
    const std::size_t n = std::min(sizeof(T), size_);
    std::memcpy(&v, data_, n);
    data_ += n;
    size_ -= n;
    return v;
  }

  std::span<const std::byte> rest_bytes() const { return {reinterpret_cast<const std::byte*>(data_), size_}; }
  std::string_view rest_text() const { return {reinterpret_cast<const char*>(data_), size_}; }
  std::size_t size() const { return size_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
};

// A property the target checks on inputs the parser accepted; a violation must crash (libFuzzer saves it).
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz property violated: %s\n", what);
    std::abort();
  }
}

}  // namespace shardkit::fuzz
