#pragma once
//! gloo's rendezvous store interface over any shardkit store, so gloo contexts rendezvous through the same
//! TCP store (or memory store) the rest of the job uses.
#include <gloo/rendezvous/store.h>

#include <chrono>
#include <string>
#include <vector>

#include "shardkit/rendezvous/store.hpp"

namespace shardkit::backends::detail::gloo {

class store_adapter final : public ::gloo::rendezvous::Store {
 public:
  //! `timeout` bounds get() and wait() without their own timeout (gloo's get() has none).
  store_adapter(rendezvous::any_store store, std::chrono::milliseconds timeout) : store_(std::move(store)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override { store_.set(key, std::string(data.begin(), data.end())); }

  std::vector<char> get(const std::string& key) override {
    const std::string v = store_.get(key, timeout_);
    return {v.begin(), v.end()};
  }

  void wait(const std::vector<std::string>& keys) override { store_.wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    // gloo passes its context timeout; never wait longer than ours.
    store_.wait(keys, timeout.count() > 0 && timeout < timeout_ ? timeout : timeout_);
  }

 private:
  rendezvous::any_store store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace shardkit::backends::detail::gloo
