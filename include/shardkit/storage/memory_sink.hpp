#pragma once
//! A sink in this process's memory: for tests, for ranks that are threads of one process, and for staging objects
//! before they go to a slower sink.
//!
//! Objects are immutable byte vectors behind shared pointers: a commit swaps the pointer under the lock, and a get
//! copies the pointer under the lock and the bytes outside it, so a large read never blocks writers and always sees
//! one whole version of an object. A writer buffers its object privately until commit, so nothing is visible
//! before. Writers keep the sink's state alive, so they may outlive the memory_sink object itself.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::storage {

namespace detail {
struct memory_sink_state {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<const std::vector<std::byte>>> objects;
};
}  // namespace detail

class memory_sink {
 public:
  using sink_concept = sink_tag;

  class writer {
   public:
    // Moving into a writer releases what it held (state_, bytes_), all that abort() does.
    writer(writer&&) noexcept = default;
    writer& operator=(writer&&) noexcept = default;
    ~writer() { abort(); }

    void write(std::span<const std::byte> bytes) {
      check_open("sink.write");
      try {
        bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
      } catch (const std::bad_alloc&) {
        failed_ = true;
        throw_error(errc::out_of_memory, "buffering " + std::to_string(bytes.size()) + " more bytes",
                    {.operation = "sink.write", .object = key_});
      }
    }

    void commit() {
      check_open("sink.commit");
      if (failed_) {
        abort();
        throw_error(errc::aborted, "an earlier write failed; nothing was committed",
                    {.operation = "sink.commit", .object = key_});
      }
      auto object = std::make_shared<const std::vector<std::byte>>(std::move(bytes_));
      auto state = std::move(state_);
      std::lock_guard lock(state->mutex);
      state->objects[key_] = std::move(object);
    }

    void abort() noexcept {
      state_.reset();
      bytes_ = {};
    }

   private:
    friend class memory_sink;
    writer(std::shared_ptr<detail::memory_sink_state> state, std::string key)
        : state_(std::move(state)), key_(std::move(key)) {}
    void check_open(const char* operation) const {
      if (!state_) throw_error(errc::closed, "the writer was already committed or aborted", {.operation = operation, .object = key_});
    }

    std::shared_ptr<detail::memory_sink_state> state_;  // null once finished
    std::string key_;
    std::vector<std::byte> bytes_;
    bool failed_ = false;
  };

  memory_sink() = default;
  memory_sink(const memory_sink&) = delete;
  memory_sink& operator=(const memory_sink&) = delete;

  writer put(const std::string& key) {
    check_key(key, "sink.put");
    return writer(state_, key);
  }

  //! Writes the object only if the key has none (sink_puts_new): true if it wrote it.
  bool put_new(const std::string& key, std::span<const std::byte> bytes) {
    check_key(key, "sink.put");
    auto object = std::make_shared<const std::vector<std::byte>>(bytes.begin(), bytes.end());
    std::lock_guard lock(state_->mutex);
    return state_->objects.emplace(key, std::move(object)).second;
  }

  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    check_key(key, "sink.get");
    auto object = find(key);
    if (!object) throw_error(errc::not_found, "no such object", {.operation = "sink.get", .object = key});
    if (offset >= object->size()) return 0;
    const std::size_t n = std::min<std::uint64_t>(out.size(), object->size() - offset);
    if (n) std::memcpy(out.data(), object->data() + offset, n);
    return n;
  }

  std::optional<std::uint64_t> size(const std::string& key) {
    check_key(key, "sink.size");
    auto object = find(key);
    if (!object) return std::nullopt;
    return object->size();
  }

  bool exists(const std::string& key) { return size(key).has_value(); }

  std::vector<std::string> list(const std::string& prefix) {
    check_prefix(prefix, "sink.list");
    std::vector<std::string> keys;
    std::lock_guard lock(state_->mutex);
    for (auto it = state_->objects.lower_bound(prefix); it != state_->objects.end() && it->first.starts_with(prefix); ++it)
      keys.push_back(it->first);
    return keys;  // std::map orders std::string byte-wise already
  }

  bool remove(const std::string& key) {
    check_key(key, "sink.remove");
    std::lock_guard lock(state_->mutex);
    return state_->objects.erase(key) > 0;
  }

  //! Moves the object of `from` to `to` under the lock (sink_moves). errc::not_found when `from` has none.
  void move(const std::string& from, const std::string& to) {
    check_key(from, "sink.move");
    check_key(to, "sink.move");
    std::lock_guard lock(state_->mutex);
    auto it = state_->objects.find(from);
    if (it == state_->objects.end()) throw_error(errc::not_found, "no such object", {.operation = "sink.move", .object = from});
    auto object = it->second;
    state_->objects.erase(it);
    state_->objects[to] = std::move(object);
  }

  //! Bytes held by committed objects (for tests and staging budgets).
  std::uint64_t bytes_stored() const {
    std::lock_guard lock(state_->mutex);
    std::uint64_t total = 0;
    for (const auto& [key, object] : state_->objects) total += object->size();
    return total;
  }

 private:
  std::shared_ptr<const std::vector<std::byte>> find(const std::string& key) const {
    std::lock_guard lock(state_->mutex);
    auto it = state_->objects.find(key);
    return it == state_->objects.end() ? nullptr : it->second;
  }

  std::shared_ptr<detail::memory_sink_state> state_ = std::make_shared<detail::memory_sink_state>();
};

static_assert(sink<memory_sink> && sink_puts_new<memory_sink> && sink_moves<memory_sink>);

}  // namespace shardkit::storage
