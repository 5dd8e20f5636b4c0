// docs/concepts.md's storage sink: objects in a std::map, each published whole by its writer's commit(). Two ranks
// save a checkpoint into it with shardkit::ckpt and load it back.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <shardkit/ckpt/checkpointer.hpp>
#include <shardkit/comm/loopback_world.hpp>
#include <shardkit/storage/sink.hpp>

namespace sk = shardkit;

class map_sink {
 public:
  using sink_concept = sk::storage::sink_tag;

  class writer {
   public:
    writer(map_sink* sink, std::string key) : sink_(sink), key_(std::move(key)) {}
    writer(writer&& other) noexcept
        : sink_(std::exchange(other.sink_, nullptr)), key_(std::move(other.key_)), bytes_(std::move(other.bytes_)) {}
    ~writer() { abort(); }

    void write(std::span<const std::byte> bytes) {
      if (!sink_) sk::throw_error(sk::errc::closed, "write after commit or abort", {.operation = "sink.write", .object = key_});
      bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
    }
    void commit() {  // the whole object at once: a reader sees the old one or this one, never a part
      if (!sink_) sk::throw_error(sk::errc::closed, "commit after commit or abort", {.operation = "sink.commit", .object = key_});
      std::lock_guard lock(sink_->mutex_);
      sink_->objects_[key_] = std::move(bytes_);
      sink_ = nullptr;
    }
    void abort() noexcept { sink_ = nullptr, bytes_.clear(); }

   private:
    map_sink* sink_;  // null once finished
    std::string key_;
    std::vector<std::byte> bytes_;
  };

  writer put(const std::string& key) {
    sk::storage::check_key(key, "sink.put");
    return writer(this, key);
  }
  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    std::lock_guard lock(mutex_);
    auto it = objects_.find(key);
    if (it == objects_.end()) sk::throw_error(sk::errc::not_found, "no such object", {.operation = "sink.get", .object = key});
    const auto& bytes = it->second;
    const std::size_t n = offset >= bytes.size() ? 0 : std::min<std::size_t>(out.size(), bytes.size() - offset);
    if (n) std::memcpy(out.data(), bytes.data() + offset, n);
    return n;
  }
  std::optional<std::uint64_t> size(const std::string& key) {
    std::lock_guard lock(mutex_);
    auto it = objects_.find(key);
    return it == objects_.end() ? std::nullopt : std::optional<std::uint64_t>(it->second.size());
  }
  bool exists(const std::string& key) { return size(key).has_value(); }
  std::vector<std::string> list(const std::string& prefix) {  // std::map's order is byte-wise
    sk::storage::check_prefix(prefix, "sink.list");
    std::lock_guard lock(mutex_);
    std::vector<std::string> keys;
    for (auto it = objects_.lower_bound(prefix); it != objects_.end() && it->first.starts_with(prefix); ++it)
      keys.push_back(it->first);
    return keys;
  }
  bool remove(const std::string& key) {
    std::lock_guard lock(mutex_);
    return objects_.erase(key) > 0;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, std::vector<std::byte>> objects_;
};
static_assert(sk::storage::sink<map_sink>);

struct piece {  // what state_dict::add_shards takes (fsdp's sharded_state() hands out the same)
  std::string name;
  std::vector<std::size_t> shape;
  std::size_t begin, end;
  std::span<float> data;
};

int main() {
  constexpr int n = 2;
  constexpr std::size_t total = 1000;  // a 1000-element tensor, half on each rank
  auto objects = std::make_shared<map_sink>();
  sk::storage::any_sink sink(objects);  // what the checkpointer takes: one sink that every rank shares here
  auto groups = sk::comm::make_loopback_world(n);
  std::vector<int> wrong(n, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      const std::size_t begin = std::size_t(r) * total / n, end = std::size_t(r + 1) * total / n;
      std::vector<float> shard(end - begin);
      for (std::size_t i = begin; i < end; ++i) shard[i - begin] = float(i) * 0.5f;
      std::uint64_t steps = 42;
      sk::ckpt::state_dict state;
      state.add_shards(std::vector{piece{"w", {total}, begin, end, shard}});
      state.add_value("optim.steps", steps);

      sk::ckpt::checkpointer ckpt(groups[std::size_t(r)], sink);
      ckpt.save(10, state).wait();
      std::ranges::fill(shard, 0.0f), steps = 0;
      auto loaded = ckpt.load_latest(state);
      wrong[std::size_t(r)] += !loaded || loaded->step != 10 || steps != 42;
      for (std::size_t i = begin; i < end; ++i) wrong[std::size_t(r)] += shard[i - begin] != float(i) * 0.5f;
    });
  for (auto& t : ranks) t.join();
  const auto keys = objects->list("");
  for (const auto& k : keys) std::printf("  %s (%llu bytes)\n", k.c_str(), (unsigned long long)*objects->size(k));
  const int bad = wrong[0] + wrong[1] + (keys.size() < 3);  // an index and a file per rank at least
  std::printf("%s: %d wrong results\n", bad ? "FAIL" : "OK", bad);
  return bad ? 1 : 0;
}
