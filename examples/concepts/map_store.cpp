// docs/concepts.md's rendezvous store: keys in a std::map behind a mutex, waiters woken by a condition variable.
// Four ranks (threads) connect the shared-memory transport through it and run an all_reduce.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <shardkit/comm/p2p_communicator.hpp>
#include <shardkit/comm/process_group.hpp>
#include <shardkit/rendezvous/store.hpp>
#include <shardkit/transport/shm.hpp>

namespace sk = shardkit;

class map_store {
 public:
  using store_concept = sk::rendezvous::store_tag;

  void set(const std::string& key, const std::string& value) {
    std::lock_guard lock(mutex_);
    data_[key] = value;
    changed_.notify_all();
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    wait_for(lock, std::span(&key, 1), timeout);
    return data_.at(key);
  }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    wait_for(lock, keys, timeout);
  }
  bool check(std::span<const std::string> keys) {
    std::lock_guard lock(mutex_);
    return std::ranges::all_of(keys, [&](const auto& k) { return data_.contains(k); });
  }
  std::int64_t add(const std::string& key, std::int64_t delta) {
    std::lock_guard lock(mutex_);
    std::int64_t value = delta;
    if (auto it = data_.find(key); it != data_.end()) {
      std::size_t used = 0;
      try {
        value += std::stoll(it->second, &used);
      } catch (const std::exception&) {
      }
      if (used == 0 || used != it->second.size())
        sk::throw_error(sk::errc::invalid_argument, "value is not an integer counter", {.operation = "store.add", .object = key});
    }
    data_[key] = std::to_string(value);
    changed_.notify_all();
    return value;
  }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
    std::lock_guard lock(mutex_);
    auto it = data_.find(key);
    if (it == data_.end() ? !expected.empty() : it->second != expected)
      return it == data_.end() ? expected : it->second;  // no swap: as torch, a missing key answers `expected`
    data_[key] = desired;
    changed_.notify_all();
    return desired;
  }
  bool remove(const std::string& key) {
    std::lock_guard lock(mutex_);
    return data_.erase(key) > 0;
  }
  std::int64_t num_keys() {
    std::lock_guard lock(mutex_);
    return std::int64_t(data_.size());
  }

 private:
  void wait_for(std::unique_lock<std::mutex>& lock, std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    auto all_there = [&] { return std::ranges::all_of(keys, [&](const auto& k) { return data_.contains(k); }); };
    if (timeout.count() <= 0) return changed_.wait(lock, all_there);  // zero or less: forever
    if (changed_.wait_for(lock, timeout, all_there)) return;
    std::string missing;
    for (const auto& k : keys)
      if (!data_.contains(k)) missing += (missing.empty() ? "" : ", ") + k;
    sk::throw_error(sk::errc::timeout, "still missing: " + missing, {.operation = "store.wait"});
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> data_;
};
static_assert(sk::rendezvous::store<map_store>);

int main() {
  constexpr int n = 4;
  auto store = sk::rendezvous::make_store<map_store>();  // any_store: what transports and groups take
  int wrong = 0;
  try {
    store.get("nobody-sets-this", std::chrono::milliseconds(50));
    ++wrong;
  } catch (const sk::error& e) {
    wrong += e.code() != sk::errc::timeout;
  }
  wrong += store.compare_set("leader", "", "rank 0") != "rank 0" || store.compare_set("leader", "", "rank 1") != "rank 0";

  std::vector<int> sums(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      // Rank r's shared-memory segment is found by the others through keys this store holds.
      auto shm = sk::transport::shm_transport::connect(sk::rendezvous::make_store<sk::rendezvous::prefix_store>(store, "job"), r, n);
      auto pg = sk::comm::process_group::create(sk::comm::p2p_communicator<sk::transport::shm_transport>(shm));
      int x = r + 1;
      pg.all_reduce(sk::buffer_view(std::span<int>(&x, 1))).wait();
      sums[std::size_t(r)] = x;
    });
  for (auto& t : ranks) t.join();
  for (int s : sums) wrong += s != n * (n + 1) / 2;
  std::printf("%s: %d wrong results (%lld keys in the store)\n", wrong ? "FAIL" : "OK", wrong, (long long)store.num_keys());
  return wrong ? 1 : 0;
}
