#pragma once
//! An in-process store for ranks that are threads of one process (tests, single-host demos).
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <span>
#include <string>

#include "shardkit/core/completion.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::rendezvous {

class memory_store {
 public:
  using store_concept = store_tag;

  void set(const std::string& key, const std::string& value) {
    {
      std::lock_guard lock(mutex_);
      data_[key] = value;
    }
    cv_.notify_all();
  }

  std::string get(const std::string& key, std::chrono::milliseconds timeout = default_store_timeout) {
    std::unique_lock lock(mutex_);
    wait_locked(lock, std::span<const std::string>(&key, 1), timeout, "store.get");
    return data_.at(key);
  }

  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout = default_store_timeout) {
    std::unique_lock lock(mutex_);
    wait_locked(lock, keys, timeout, "store.wait");
  }

  bool check(std::span<const std::string> keys) {
    std::lock_guard lock(mutex_);
    return all_present(keys);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) {
    std::int64_t result;
    {
      std::lock_guard lock(mutex_);
      auto it = data_.find(key);
      std::int64_t current = 0;
      if (it != data_.end()) {
        try {
          current = std::stoll(it->second);
        } catch (const std::exception&) {
          throw_error(errc::invalid_argument, "value is not an integer counter", {.operation = "store.add", .object = key});
        }
      }
      result = current + delta;
      data_[key] = std::to_string(result);
    }
    cv_.notify_all();
    return result;
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
    std::string now;
    {
      std::lock_guard lock(mutex_);
      auto it = data_.find(key);
      if (it == data_.end()) {
        if (!expected.empty()) return expected;  // torch: a missing key reports the expected value back unchanged
        data_[key] = desired;
        now = desired;
      } else if (it->second == expected) {
        it->second = desired;
        now = desired;
      } else {
        return it->second;
      }
    }
    cv_.notify_all();
    return now;
  }

  bool remove(const std::string& key) {
    std::lock_guard lock(mutex_);
    return data_.erase(key) > 0;
  }

  std::int64_t num_keys() {
    std::lock_guard lock(mutex_);
    return static_cast<std::int64_t>(data_.size());
  }

 private:
  bool all_present(std::span<const std::string> keys) const {
    for (const auto& k : keys)
      if (!data_.contains(k)) return false;
    return true;
  }

  void wait_locked(std::unique_lock<std::mutex>& lock, std::span<const std::string> keys,
                   std::chrono::milliseconds timeout, const char* op) {
    const auto pred = [&] { return all_present(keys); };
    if (timeout.count() <= 0) {
      cv_.wait(lock, pred);
      return;
    }
    if (!cv_.wait_for(lock, timeout, pred)) {
      std::string missing;
      for (const auto& k : keys)
        if (!data_.contains(k)) missing += (missing.empty() ? "" : ", ") + k;
      throw_error(errc::timeout, "after " + std::to_string(timeout.count()) + " ms still missing: " + missing,
                  {.operation = op});
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::string> data_;
};

}  // namespace shardkit::rendezvous
