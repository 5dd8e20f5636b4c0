#pragma once
//! A sink wrapper that injects the failures real storage has, so the checkpointer's tests can prove that none of
//! them produces a corrupt or partial load.
//!
//! What it injects, each by a probability of a seeded policy (and deterministically by inject_next()):
//! - errors: put() (opening a writer), commit(), get() and list() throw errc::io whose detail starts "injected";
//! - short writes: a write() passes only the first half of its chunk to the inner writer, then throws; the writer
//!   is then broken, and its commit throws errc::aborted: the object never becomes visible;
//! - lost commit acknowledgements: commit() commits, then throws, as when S3's reply to CompleteMultipartUpload is
//!   lost: the caller must not take a throw as proof that nothing was written;
//! - delayed visibility: a newly committed object (its key absent before) is missed by get/size/exists/list (absent,
//!   errc::not_found on get) for the next visibility_delay_calls read calls on this sink, counting calls for any key,
//!   and for at least visibility_delay after its commit, as on an eventually consistent store or mount (s3fs: seed
//!   000). Replacing an existing object is not delayed (stale reads of the old version are not simulated: the
//!   checkpointer never replaces one);
//! - slow calls: any call sleeps slow_call_delay with probability slow_call, before doing its work.
//! Counters say what was injected, so a test can assert that its faults actually happened.
//!
//! Determinism: one generator seeded from the policy, drawn under a lock, and only for a fault whose probability is
//! strictly between 0 and 1; from one thread, the same seed and calls give the same faults. Bad keys are refused
//! before any draw. The inner sink is any sink (an any_sink), usually a memory_sink or a posix_sink.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::storage {

//! Probabilities in [0, 1]; 0 (the default everywhere) never injects.
struct fault_policy {
  std::uint64_t seed = 1;
  double put_error = 0;        //!< put() throws; no writer exists
  double short_write = 0;      //!< write() passes half its chunk on, then throws; the object never becomes visible
  double commit_error = 0;     //!< commit() throws; nothing was committed
  double lost_commit_ack = 0;  //!< commit() commits, then throws
  double get_error = 0;        //!< get() throws
  double list_error = 0;       //!< list() throws
  std::uint32_t visibility_delay_calls = 0;        //!< a new object is missed by this many later read calls...
  std::chrono::milliseconds visibility_delay{0};  //!< ...and for at least this long after its commit
  double slow_call = 0;                             //!< a call sleeps slow_call_delay first
  std::chrono::milliseconds slow_call_delay{0};
};

//! The faults inject_next() can force.
enum class fault { put_error, short_write, commit_error, lost_commit_ack, get_error, list_error };

//! What a faulty_sink injected so far.
struct fault_counters {
  std::uint64_t put_errors = 0;
  std::uint64_t short_writes = 0;
  std::uint64_t commit_errors = 0;
  std::uint64_t lost_commit_acks = 0;
  std::uint64_t get_errors = 0;
  std::uint64_t list_errors = 0;
  std::uint64_t delayed_objects = 0;  //!< commits whose object was hidden for a while
  std::uint64_t hidden_reads = 0;     //!< read calls whose answer left out a hidden object
  std::uint64_t slow_calls = 0;

  std::uint64_t injected_errors() const noexcept {
    return put_errors + short_writes + commit_errors + lost_commit_acks + get_errors + list_errors;
  }
};

namespace detail {
class faulty_state {
 public:
  faulty_state(any_sink inner, const fault_policy& policy) : inner(std::move(inner)) { set_policy(policy); }

  void set_policy(const fault_policy& policy) {
    std::lock_guard lock(mutex_);
    policy_ = policy;
    rng_.seed(policy.seed);
  }
  fault_policy policy() const {
    std::lock_guard lock(mutex_);
    return policy_;
  }
  void inject_next(fault f, int times) {
    std::lock_guard lock(mutex_);
    forced_[static_cast<std::size_t>(f)] += times;
  }
  fault_counters counters() const {
    std::lock_guard lock(mutex_);
    return counters_;
  }

  // Whether to inject f now; counts it if so.
  bool draw(fault f) {
    std::lock_guard lock(mutex_);
    auto& forced = forced_[static_cast<std::size_t>(f)];
    bool hit = false;
    if (forced > 0) {
      --forced;
      hit = true;
    } else {
      hit = chance(probability(f));
    }
    if (hit) ++count_of(f);
    return hit;
  }

  void maybe_slow() {
    std::chrono::milliseconds delay{0};
    {
      std::lock_guard lock(mutex_);
      if (policy_.slow_call_delay.count() > 0 && chance(policy_.slow_call)) {
        delay = policy_.slow_call_delay;
        ++counters_.slow_calls;
      }
    }
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
  }

  // Before a commit of key: hides it if it is new and visibility is delayed. Returns whether it did.
  bool hide_if_new(const std::string& key) {
    fault_policy p = policy();
    if (p.visibility_delay_calls == 0 && p.visibility_delay.count() <= 0) return false;
    if (inner.exists(key)) return false;
    std::lock_guard lock(mutex_);
    hidden_[key] = hidden_object{p.visibility_delay_calls, std::chrono::steady_clock::now() + p.visibility_delay};
    return true;
  }
  void delayed(bool counted) {
    if (!counted) return;
    std::lock_guard lock(mutex_);
    ++counters_.delayed_objects;
  }
  void unhide(const std::string& key) {
    std::lock_guard lock(mutex_);
    hidden_.erase(key);
  }
  void reveal_all() {
    std::lock_guard lock(mutex_);
    hidden_.clear();
  }

  // One read call: the keys hidden from it (those matching `matches`); then the call counts toward every hidden
  // object's delay.
  template <class Matches>
  std::vector<std::string> read_call(const Matches& matches) {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::string> hidden;
    for (auto it = hidden_.begin(); it != hidden_.end();) {
      if (it->second.calls_left == 0 && now >= it->second.visible_at) {
        it = hidden_.erase(it);
        continue;
      }
      if (matches(it->first)) hidden.push_back(it->first);
      if (it->second.calls_left > 0) --it->second.calls_left;
      ++it;
    }
    if (!hidden.empty()) ++counters_.hidden_reads;
    return hidden;
  }

  any_sink inner;

 private:
  struct hidden_object {
    std::uint32_t calls_left;
    std::chrono::steady_clock::time_point visible_at;
  };

  bool chance(double p) {
    if (p <= 0) return false;
    if (p >= 1) return true;
    return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < p;
  }
  double probability(fault f) const {
    switch (f) {
      case fault::put_error: return policy_.put_error;
      case fault::short_write: return policy_.short_write;
      case fault::commit_error: return policy_.commit_error;
      case fault::lost_commit_ack: return policy_.lost_commit_ack;
      case fault::get_error: return policy_.get_error;
      case fault::list_error: return policy_.list_error;
    }
    return 0;
  }
  std::uint64_t& count_of(fault f) {
    switch (f) {
      case fault::put_error: return counters_.put_errors;
      case fault::short_write: return counters_.short_writes;
      case fault::commit_error: return counters_.commit_errors;
      case fault::lost_commit_ack: return counters_.lost_commit_acks;
      case fault::get_error: return counters_.get_errors;
      case fault::list_error: return counters_.list_errors;
    }
    return counters_.list_errors;
  }

  mutable std::mutex mutex_;
  fault_policy policy_;
  std::mt19937_64 rng_;
  int forced_[6] = {};
  fault_counters counters_;
  std::map<std::string, hidden_object> hidden_;
};
}  // namespace detail

class faulty_sink {
 public:
  using sink_concept = sink_tag;

  class writer {
   public:
    writer(writer&& o) noexcept
        : state_(std::move(o.state_)), inner_(std::move(o.inner_)), key_(std::move(o.key_)), failed_(o.failed_),
          finished_(std::exchange(o.finished_, true)) {}
    writer& operator=(writer&& o) noexcept {
      if (this != &o) {
        abort();
        state_ = std::move(o.state_);
        inner_ = std::move(o.inner_);
        key_ = std::move(o.key_);
        failed_ = o.failed_;
        finished_ = std::exchange(o.finished_, true);
      }
      return *this;
    }
    ~writer() { abort(); }

    void write(std::span<const std::byte> bytes) {
      check_open("sink.write");
      state_->maybe_slow();
      if (state_->draw(fault::short_write)) {
        failed_ = true;
        const std::size_t half = bytes.size() / 2;
        try {
          inner_.write(bytes.first(half));
        } catch (...) {
        }
        throw_error(errc::io,
                    "injected short write: " + std::to_string(half) + " of " + std::to_string(bytes.size()) + " bytes written",
                    {.operation = "sink.write", .object = key_});
      }
      try {
        inner_.write(bytes);
      } catch (...) {
        failed_ = true;
        throw;
      }
    }

    void commit() {
      check_open("sink.commit");
      state_->maybe_slow();
      if (failed_) {
        abort();
        throw_error(errc::aborted, "an earlier write failed; nothing was committed",
                    {.operation = "sink.commit", .object = key_});
      }
      if (state_->draw(fault::commit_error)) {
        abort();
        throw_error(errc::io, "injected commit error; nothing was committed", {.operation = "sink.commit", .object = key_});
      }
      // Hidden before the inner commit, so no reader sees it in between.
      const bool hidden = state_->hide_if_new(key_);
      finished_ = true;
      try {
        inner_.commit();
      } catch (...) {
        if (hidden) state_->unhide(key_);
        throw;
      }
      state_->delayed(hidden);
      if (state_->draw(fault::lost_commit_ack))
        throw_error(errc::io, "injected lost commit acknowledgement; the object was committed",
                    {.operation = "sink.commit", .object = key_});
    }

    void abort() noexcept {
      if (finished_) return;
      finished_ = true;
      inner_.abort();
    }

   private:
    friend class faulty_sink;
    writer(std::shared_ptr<detail::faulty_state> state, any_object_writer inner, std::string key)
        : state_(std::move(state)), inner_(std::move(inner)), key_(std::move(key)) {}
    void check_open(const char* operation) const {
      if (finished_)
        throw_error(errc::closed, "the writer was already committed or aborted", {.operation = operation, .object = key_});
    }

    std::shared_ptr<detail::faulty_state> state_;
    any_object_writer inner_;
    std::string key_;
    bool failed_ = false;
    bool finished_ = false;
  };

  explicit faulty_sink(any_sink inner, fault_policy policy = {})
      : state_(std::make_shared<detail::faulty_state>(std::move(inner), policy)) {
    if (!state_->inner) throw_error(errc::invalid_argument, "faulty_sink over an empty any_sink");
  }
  template <sink S>
    requires(!std::same_as<S, any_sink>)
  explicit faulty_sink(std::shared_ptr<S> inner, fault_policy policy = {}) : faulty_sink(any_sink(std::move(inner)), policy) {}

  writer put(const std::string& key) {
    check_key(key, "sink.put");
    state_->maybe_slow();
    if (state_->draw(fault::put_error)) throw_error(errc::io, "injected put error", {.operation = "sink.put", .object = key});
    return writer(state_, state_->inner.put(key), key);
  }

  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    check_key(key, "sink.get");
    state_->maybe_slow();
    if (state_->draw(fault::get_error)) throw_error(errc::io, "injected get error", {.operation = "sink.get", .object = key});
    if (hidden(key))
      throw_error(errc::not_found, "no such object (committed, not visible yet: injected delay)",
                  {.operation = "sink.get", .object = key});
    return state_->inner.get(key, offset, out);
  }

  std::optional<std::uint64_t> size(const std::string& key) {
    check_key(key, "sink.size");
    state_->maybe_slow();
    if (hidden(key)) return std::nullopt;
    return state_->inner.size(key);
  }

  bool exists(const std::string& key) { return size(key).has_value(); }

  std::vector<std::string> list(const std::string& prefix) {
    check_prefix(prefix, "sink.list");
    state_->maybe_slow();
    if (state_->draw(fault::list_error))
      throw_error(errc::io, "injected list error", {.operation = "sink.list", .object = prefix});
    const auto hidden = state_->read_call([&](const std::string& k) { return k.starts_with(prefix); });
    auto keys = state_->inner.list(prefix);
    std::erase_if(keys, [&](const std::string& k) { return std::find(hidden.begin(), hidden.end(), k) != hidden.end(); });
    return keys;
  }

  //! Forwarded to the inner sink, without faults: what a sweep finds is not a fault path under test.
  std::vector<temporary_object> temporaries(const std::string& prefix) { return state_->inner.temporaries(prefix); }
  std::size_t remove_stale_temporaries(std::chrono::seconds older_than, const std::string& prefix) {
    return state_->inner.remove_stale_temporaries(older_than, prefix);
  }
  //! The inner sink's (sink_limits_keys): faults never change what a key may be.
  sink_key_limits key_limits() const { return state_->inner.key_limits(); }
  bool remove(const std::string& key) {
    check_key(key, "sink.remove");
    state_->maybe_slow();
    state_->unhide(key);
    return state_->inner.remove(key);
  }

  //! Replaces the policy and reseeds its generator (turn faults off to verify what was written, for instance).
  void set_policy(const fault_policy& policy) { state_->set_policy(policy); }
  fault_policy policy() const { return state_->policy(); }
  //! Forces fault f on its next `times` opportunities, whatever the probabilities.
  void inject_next(fault f, int times = 1) { state_->inject_next(f, times); }
  fault_counters counters() const { return state_->counters(); }
  //! Makes every object whose visibility is delayed visible now.
  void reveal_all() { state_->reveal_all(); }
  //! The wrapped sink, seen without faults.
  any_sink& inner() noexcept { return state_->inner; }

 private:
  bool hidden(const std::string& key) {
    return !state_->read_call([&](const std::string& k) { return k == key; }).empty();
  }

  std::shared_ptr<detail::faulty_state> state_;
};

static_assert(sink<faulty_sink> && sink_limits_keys<faulty_sink>);

}  // namespace shardkit::storage
