// Compiled by tests/storage/CMakeLists.txt with -fsyntax-only, once per case: each case must fail to compile, and
// the compiler must name the part of the sink concept that is missing. Without a case it compiles.
#include "shardkit/storage/memory_sink.hpp"

namespace st = shardkit::storage;

// A minimal user sink: every requirement of storage::sink, each stubbed.
struct user_sink {
  using sink_concept = st::sink_tag;
  struct writer {
    void write(std::span<const std::byte>) {}
    void commit() {}
#if defined(SHARDKIT_CASE_ABORT_MAY_THROW)
    void abort() {}
#elif !defined(SHARDKIT_CASE_NO_ABORT)
    void abort() noexcept {}
#endif
  };
  writer put(const std::string&) { return {}; }
  std::size_t get(const std::string&, std::uint64_t, std::span<std::byte>) { return 0; }
  std::optional<std::uint64_t> size(const std::string&) { return std::nullopt; }
  bool exists(const std::string&) { return false; }
#if !defined(SHARDKIT_CASE_NO_LIST)
  std::vector<std::string> list(const std::string&) { return {}; }
#endif
  bool remove(const std::string&) { return false; }
};

// The same members without the opt-in tag: never a sink by accident.
struct untagged_sink {
  struct writer {
    void write(std::span<const std::byte>) {}
    void commit() {}
    void abort() noexcept {}
  };
  writer put(const std::string&) { return {}; }
  std::size_t get(const std::string&, std::uint64_t, std::span<std::byte>) { return 0; }
  std::optional<std::uint64_t> size(const std::string&) { return std::nullopt; }
  bool exists(const std::string&) { return false; }
  std::vector<std::string> list(const std::string&) { return {}; }
  bool remove(const std::string&) { return false; }
};

static_assert(st::sink<st::memory_sink>);
#if defined(SHARDKIT_CASE_NO_TAG)
static_assert(st::sink<untagged_sink>);
#else
static_assert(st::sink<user_sink>);
#endif

int main() {}
