#pragma once
//! The key-value store concept (like torch's TCPStore) used for rendezvous, plus a type-erased handle.
//!
//! A type S models shardkit::rendezvous::store when it opts in with
//! `using store_concept = shardkit::rendezvous::store_tag;` and supports (values are binary-safe std::strings):
//!
//! | expression                         | result        | semantics                                                       |
//! |------------------------------------|---------------|-----------------------------------------------------------------|
//! | s.set(key, value)                  | void          | stores value, waking waiters                                    |
//! | s.get(key, timeout)                | std::string   | waits for key up to timeout, then errc::timeout naming the key  |
//! | s.wait(keys, timeout)              | void          | waits for all keys; errc::timeout lists the missing ones        |
//! | s.check(keys)                      | bool          | true if all keys exist now                                      |
//! | s.add(key, delta)                  | std::int64_t  | atomically adds to a decimal counter (missing = 0); new value;  |
//! |                                    |               | errc::invalid_argument if the value is not an integer           |
//! | s.compare_set(key, expected, want) | std::string   | atomically sets want if the value is expected (or key missing   |
//! |                                    |               | and expected is empty) and returns want; else returns the value |
//! |                                    |               | stored, or expected itself if the key is missing (as torch)     |
//! | s.remove(key)                      | bool          | deletes key; true if it existed                                 |
//! | s.num_keys()                       | std::int64_t  | number of keys                                                  |
//!
//! (key and value are const std::string&, keys a std::span<const std::string>, timeout std::chrono::milliseconds.)
//! A timeout of zero or less means wait forever. set, add and compare_set wake get and wait callers waiting for
//! the key. Errors are shardkit::error: errc::timeout, errc::invalid_argument, and for a remote store errc::io or
//! errc::peer_lost when its server cannot be reached. Every operation is thread-safe: the ranks of one process
//! (and a transport's connect) call one store from several threads at once.
#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::rendezvous {

struct store_tag {};

//! While one lives, every request that this thread makes to a remote store (tcp_store) ends by `until`: one still
//! unanswered then fails with errc::timeout, and its connection is closed as a lost one is (later requests fail
//! with errc::closed). For a caller that must not wait on a store whose host stopped answering: process_group's
//! fault reports, made after a collective failed. In-process stores need none (their waits take a timeout).
class request_bound {
 public:
  explicit request_bound(deadline until) : previous_(current()) { current() = std::min(previous_, until); }
  ~request_bound() { current() = previous_; }
  request_bound(const request_bound&) = delete;
  request_bound& operator=(const request_bound&) = delete;

  //! The bound of this thread's requests now (no_deadline outside any request_bound).
  static deadline& current() noexcept {
    static thread_local deadline bound = no_deadline;
    return bound;
  }

 private:
  deadline previous_;
};

inline constexpr std::chrono::milliseconds default_store_timeout{300'000};

//! The parts of the store concept, named so that a type missing one is rejected with that part's name.
template <class S>
concept opts_into_store = requires { typename S::store_concept; } && std::same_as<typename S::store_concept, store_tag>;
template <class S>
concept store_sets_and_gets = requires(S& s, const std::string& key, const std::string& value, std::chrono::milliseconds timeout) {
  s.set(key, value);
  { s.get(key, timeout) } -> std::same_as<std::string>;
};
template <class S>
concept store_waits_for_keys = requires(S& s, std::span<const std::string> keys, std::chrono::milliseconds timeout) {
  s.wait(keys, timeout);
  { s.check(keys) } -> std::same_as<bool>;
};
template <class S>
concept store_counts_and_swaps = requires(S& s, const std::string& key, const std::string& value, std::int64_t delta) {
  { s.add(key, delta) } -> std::same_as<std::int64_t>;
  { s.compare_set(key, value, value) } -> std::same_as<std::string>;
};
template <class S>
concept store_removes_keys = requires(S& s, const std::string& key) {
  { s.remove(key) } -> std::same_as<bool>;
  { s.num_keys() } -> std::same_as<std::int64_t>;
};

template <class S>
concept store = opts_into_store<S> && store_sets_and_gets<S> && store_waits_for_keys<S> && store_counts_and_swaps<S> &&
                store_removes_keys<S>;

namespace detail {
struct store_interface {
  virtual ~store_interface() = default;
  virtual void set(const std::string&, const std::string&) = 0;
  virtual std::string get(const std::string&, std::chrono::milliseconds) = 0;
  virtual void wait(std::span<const std::string>, std::chrono::milliseconds) = 0;
  virtual bool check(std::span<const std::string>) = 0;
  virtual std::int64_t add(const std::string&, std::int64_t) = 0;
  virtual std::string compare_set(const std::string&, const std::string&, const std::string&) = 0;
  virtual bool remove(const std::string&) = 0;
  virtual std::int64_t num_keys() = 0;
};

template <store S>
struct store_model final : store_interface {
  std::shared_ptr<S> impl;
  explicit store_model(std::shared_ptr<S> s) : impl(std::move(s)) {}
  void set(const std::string& k, const std::string& v) override { impl->set(k, v); }
  std::string get(const std::string& k, std::chrono::milliseconds t) override { return impl->get(k, t); }
  void wait(std::span<const std::string> ks, std::chrono::milliseconds t) override { impl->wait(ks, t); }
  bool check(std::span<const std::string> ks) override { return impl->check(ks); }
  std::int64_t add(const std::string& k, std::int64_t d) override { return impl->add(k, d); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& d) override {
    return impl->compare_set(k, e, d);
  }
  bool remove(const std::string& k) override { return impl->remove(k); }
  std::int64_t num_keys() override { return impl->num_keys(); }
};
}  // namespace detail

//! A copyable handle to any store (shared ownership). Process groups and transports keep one of these so they
//! are not templated on the store type.
class any_store {
 public:
  using store_concept = store_tag;

  any_store() = default;
  template <store S>
    requires(!std::same_as<S, any_store>)
  explicit any_store(std::shared_ptr<S> s) : impl_(std::make_shared<detail::store_model<S>>(std::move(s))) {}

  explicit operator bool() const noexcept { return impl_ != nullptr; }

  void set(const std::string& key, const std::string& value) { self().set(key, value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout = default_store_timeout) {
    return self().get(key, timeout);
  }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout = default_store_timeout) {
    self().wait(keys, timeout);
  }
  bool check(std::span<const std::string> keys) { return self().check(keys); }
  std::int64_t add(const std::string& key, std::int64_t delta) { return self().add(key, delta); }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
    return self().compare_set(key, expected, desired);
  }
  bool remove(const std::string& key) { return self().remove(key); }
  std::int64_t num_keys() { return self().num_keys(); }

 private:
  detail::store_interface& self() const {
    if (!impl_) throw_error(errc::invalid_argument, "use of an empty any_store");
    return *impl_;
  }
  std::shared_ptr<detail::store_interface> impl_;
};

template <store S, class... Args>
any_store make_store(Args&&... args) {
  return any_store(std::make_shared<S>(std::forward<Args>(args)...));
}

//! Every key of a store, seen through a prefix: "<prefix>/<key>". Groups use one so their keys never collide.
class prefix_store {
 public:
  using store_concept = store_tag;

  prefix_store(any_store base, std::string prefix) : base_(std::move(base)), prefix_(std::move(prefix) + "/") {}

  void set(const std::string& key, const std::string& value) { base_.set(full(key), value); }
  std::string get(const std::string& key, std::chrono::milliseconds timeout = default_store_timeout) {
    return base_.get(full(key), timeout);
  }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout = default_store_timeout) {
    auto ks = full(keys);
    base_.wait(ks, timeout);
  }
  bool check(std::span<const std::string> keys) {
    auto ks = full(keys);
    return base_.check(ks);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) { return base_.add(full(key), delta); }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
    return base_.compare_set(full(key), expected, desired);
  }
  bool remove(const std::string& key) { return base_.remove(full(key)); }
  //! Counts all keys of the underlying store (a prefix has no cheap count of its own, as in torch).
  std::int64_t num_keys() { return base_.num_keys(); }

  const std::string& prefix() const noexcept { return prefix_; }

 private:
  std::string full(const std::string& key) const { return prefix_ + key; }
  std::vector<std::string> full(std::span<const std::string> keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(full(k));
    return out;
  }
  any_store base_;
  std::string prefix_;
};

}  // namespace shardkit::rendezvous
