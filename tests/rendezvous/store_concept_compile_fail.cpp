// Compiled by tests/rendezvous/CMakeLists.txt with -fsyntax-only, once per case: each case must fail to compile,
// and the compiler must name the part of the store concept that is missing. Without a case it compiles.
#include "shardkit/rendezvous/memory_store.hpp"

namespace rdv = shardkit::rendezvous;

// A minimal user store: every requirement of rendezvous::store, each stubbed.
struct user_store {
  using store_concept = rdv::store_tag;
  void set(const std::string&, const std::string&) {}
  std::string get(const std::string&, std::chrono::milliseconds) { return {}; }
  void wait(std::span<const std::string>, std::chrono::milliseconds) {}
  bool check(std::span<const std::string>) { return true; }
#if !defined(SHARDKIT_CASE_NO_ADD)
  std::int64_t add(const std::string&, std::int64_t) { return 0; }
#endif
  std::string compare_set(const std::string&, const std::string&, const std::string&) { return {}; }
  bool remove(const std::string&) { return false; }
  std::int64_t num_keys() { return 0; }
};

// The same members without the opt-in tag: never a store by accident.
struct untagged_store {
  void set(const std::string&, const std::string&) {}
};

static_assert(rdv::store<rdv::memory_store>);
#if defined(SHARDKIT_CASE_NO_TAG)
static_assert(rdv::store<untagged_store>);
#else
static_assert(rdv::store<user_store>);
#endif

int main() {}
