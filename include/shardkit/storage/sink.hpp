#pragma once
//! The storage sink concept: where checkpoints and the data loader's token files live, plus a
//! type-erased handle. posix_sink.hpp, memory_sink.hpp, faulty_sink.hpp and s3_sink.hpp model it.
//!
//! A sink is an object store, not a file system: a flat namespace of objects named by '/'-separated keys
//! ("step-100/rank-3.safetensors"), each written (or replaced) only as a whole and read by byte ranges. There are no
//! directories to create, rename or wait for. That is deliberate: checkpointing to shared storage broke when rank 0
//! created a directory that other ranks' eventually consistent view did not show yet (seed 000), so nothing here
//! lets one rank depend on another's directory. A sink that needs directories (posix) creates the ones each writer
//! writes into, inside that writer's put.
//!
//! A type S models shardkit::storage::sink when it opts in with `using sink_concept = shardkit::storage::sink_tag;`
//! and, for `s` an S&, `key` and `prefix` const std::string&, `offset` std::uint64_t, `out` std::span<std::byte>:
//!
//! | expression                | result                       | semantics                                           |
//! |---------------------------|------------------------------|-----------------------------------------------------|
//! | s.put(key)                | W, an object_writer (below)  | starts writing a new object; nothing is visible yet |
//! | s.get(key, offset, out)   | std::size_t                  | reads bytes [offset, offset + out.size()) into out; |
//! |                           |                              | returns the count read, less than out.size() only   |
//! |                           |                              | where the object ends (0 at or past its end);       |
//! |                           |                              | errc::not_found if there is no such object          |
//! | s.size(key)               | std::optional<std::uint64_t> | the object's size; std::nullopt if it is absent     |
//! | s.exists(key)             | bool                         | s.size(key).has_value()                             |
//! | s.list(prefix)            | std::vector<std::string>     | keys of committed objects starting with prefix (a   |
//! |                           |                              | string prefix, as S3's: "step-1" also matches       |
//! |                           |                              | "step-10/x"), sorted byte-wise; "" lists all        |
//! | s.remove(key)             | bool                         | deletes the object; true if it existed              |
//!
//! and for `w` a W& and `bytes` std::span<const std::byte>, W is move-constructible and:
//!
//! | expression     | result         | semantics                                                                |
//! |----------------|----------------|--------------------------------------------------------------------------|
//! | w.write(bytes) | void           | appends bytes to the object being written (chunks of any size, in order) |
//! | w.commit()     | void           | makes the whole object visible at once under its key, replacing any      |
//! |                |                | earlier one; then get/size/list see it (an eventually consistent sink    |
//! |                |                | may show it later). If it throws, the object did not become visible,     |
//! |                |                | except where the sink documents an ambiguous outcome (posix: a failed    |
//! |                |                | directory fsync after the rename; S3: a lost CompleteMultipartUpload     |
//! |                |                | reply)                                                                   |
//! | w.abort()      | void, noexcept | discards what was written; nothing becomes visible                       |
//!
//! **Optional capability: batch delete.** A sink may also have, for `keys` a std::span<const std::string>:
//!
//! | expression          | result | semantics                                                                 |
//! |---------------------|--------|---------------------------------------------------------------------------|
//! | s.remove_many(keys) | void   | deletes every object of keys; a key with no object is not an error; no    |
//! |                     |        | order among the keys and not atomic (a throw may leave some deleted); a   |
//! |                     |        | caller that needs an order makes one call per stage. Throws errc::io      |
//! |                     |        | naming a key it could not delete                                          |
//!
//! (concept sink_removes_many). An object store deletes a thousand keys in one request this way (S3's
//! DeleteObjects: s3_sink maps it to remove_objects), where remove() costs a round trip or two per key. Callers use
//! the free function storage::remove_many(s, keys), which takes the member where there is one and otherwise calls
//! s.remove(key) key by key; any_sink forwards it the same way, so a sink behind an any_sink keeps its batch path.
//! Retention (ckpt::apply_retention) deletes through it.
//!
//! **Optional capability: sized put.** `s.put(key, size)` (size std::uint64_t) returns the same W as s.put(key)
//! for an object that will have `size` bytes, so that the sink can plan for it (s3_sink sizes its multipart parts
//! to fit S3's 10,000 parts; see docs/s3.md). Concept sink_puts_sized; callers that know the size use the free
//! function storage::put_sized(s, key, size), which falls back to s.put(key); any_sink forwards it.
//!
//! **Optional capability: temporaries.** A sink whose writers write a temporary beside the key (posix_sink; s3_sink's
//! pending multipart uploads, under the object's key) may
//! list them, s.temporaries(prefix) -> std::vector<temporary_object> (key, bytes, last modification), and remove
//! those older than an age, s.remove_stale_temporaries(older_than, prefix) -> std::size_t (concept
//! sink_keeps_temporaries; free functions storage::temporaries and storage::remove_stale_temporaries, none and 0 for
//! a sink without it; any_sink forwards them). A writer killed mid-write leaves its temporary forever otherwise: the
//! checkpointer and `shardkit-ckpt gc` sweep them.
//!
//! **Optional capability: object identity.** `s.identity(key)` -> std::string names the stored object behind an
//! existing key such that two keys of one object give the same name (posix_sink: the file's canonical path, so a
//! symlink and its target agree, or for a file of several hard links its inode and device); concept sink_names_objects, free function storage::identity_of (the key itself for
//! a sink without it); any_sink forwards it. The data loader refuses a token file listed under two keys this way.
//!
//! **Optional capability: create only.** `s.put_new(key, bytes)` (bytes std::span<const std::byte>) -> bool writes
//! a whole small object only if no object has the key, atomically: true if it wrote it, false (writing nothing) if
//! one was there (concept sink_puts_new: posix_sink links its temporary onto the key, which fails when the key
//! exists; s3_sink sends PutObject with If-None-Match: *, which S3 refuses with 412 when the key exists; memory_sink
//! under its lock). Callers use storage::put_new(s, key, bytes), which falls back to exists() then a put, not
//! atomic: a caller that needs a guarantee reads the object back. The checkpointer's lease (ckpt/lease.hpp) does.
//!
//! **Optional capability: move.** `s.move(from, to)` -> void: afterwards the object that `from` held is under `to`
//! (replacing any object there) and `from` has none; errc::not_found when `from` has no object (concept sink_moves:
//! posix_sink renames the file, no byte copied; memory_sink under its lock). Callers use storage::move_object(s,
//! from, to), which falls back to a copy through get and a sized put, in chunks, then remove(from): not atomic (a
//! failure midway leaves `from` as it was, and perhaps `to` written too). The checkpointer moves a checkpoint that
//! does not load aside with it (ckpt/catalog.hpp).
//!
//! **Optional capability: key limits.** `s.key_limits()` -> storage::sink_key_limits: the longest key and the
//! longest '/'-separated component the sink stores, and what sets them (concept sink_limits_keys: s3_sink says
//! S3's 1,024 bytes per key less its own prefix; posix_sink the file system's NAME_MAX per component and PATH_MAX
//! less its root and a writer's temporary name). Callers use storage::key_limits_of(s) (no limit for a sink without
//! it) and key_limit_problem(limits, key); any_sink forwards it. The checkpointer checks the longest key it will
//! write against it at construction, so that a too-long prefix fails at once rather than at the first save.
//!
//! - A writer is finished after commit() or abort(); a write or commit on a finished writer throws errc::closed.
//!   Destroying an unfinished writer aborts it.
//! - After a write() threw (an I/O error, a short write) the object must never become visible: commit() throws
//!   errc::aborted and discards it. So a caller that ignores a failed write still cannot publish a torn object.
//! - Readers never see a partial object: not while it is written, not after a crash of its writer. This is the
//!   property multipart upload gives on S3 (nothing exists until CompleteMultipartUpload) and write-temporary +
//!   rename gives on POSIX.
//! - Two commits of the same key: the later one wins, each whole. The checkpointer never does this (every object of
//!   a checkpoint has a new key), so sinks need not order them further.
//! - Keys: non-empty, '/'-separated components, none empty (no leading, trailing or doubled '/'), none "." or "..",
//!   none starting with ".shardkit-tmp." (reserved for temporaries), no NUL. A key that breaks a rule is refused
//!   with errc::invalid_argument naming it (check_key below). On posix a key cannot also be a "directory" of
//!   another key ("a" and "a/b"); S3 allows both; the checkpointer never uses both.
//! - Errors are shardkit::error: errc::io for a failure of the storage (its detail names the OS or service error),
//!   errc::not_found for get of a missing object, errc::invalid_argument for a bad key; context().operation is
//!   "sink.put", "sink.get", ... and context().object the key.
//! - A sink is safe to call from several threads at once (different writers, any reads); one writer is used by
//!   one thread at a time. A sink outlives the writers it handed out (any_sink keeps its sink alive for them).
//!
//! **Blocking, not asynchronous.** Every operation blocks the calling thread until done. The checkpointer persists
//! from coroutines on a thread_pool of its own (core/executor.hpp), so a blocking write occupies one pool thread and
//! the pool's size is the number of objects in flight, which is the parallelism a disk or an S3 endpoint wants
//! anyway. POSIX file I/O has no readiness-based async (a regular file is always "ready"; only io_uring is truly
//! asynchronous, and a header-only library cannot assume it), and an async concept would make every user sink carry
//! an executor and a completion protocol for no gain on the data path, where the time goes in write() and fsync().
//! Do not call a sink from the training thread or from a transport's progress thread: hop to the pool first.
//!
//! @code
//! struct my_sink {
//!   using sink_concept = shardkit::storage::sink_tag;
//!   struct writer {
//!     void write(std::span<const std::byte> bytes);
//!     void commit();
//!     void abort() noexcept;
//!   };
//!   writer put(const std::string& key);
//!   std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out);
//!   std::optional<std::uint64_t> size(const std::string& key);
//!   bool exists(const std::string& key);
//!   std::vector<std::string> list(const std::string& prefix);
//!   bool remove(const std::string& key);
//! };
//! static_assert(shardkit::storage::sink<my_sink>);
//! @endcode
#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"

namespace shardkit::storage {

//! The tag a sink names as its `sink_concept`.
struct sink_tag {};

//! The first characters of a temporary's name: reserved, so that no key can be mistaken for one.
inline constexpr std::string_view temporary_marker = ".shardkit-tmp.";

//! The parts of the concepts, named so that a type missing one is rejected with that part's name.
//! (A writer's parts are concepts of their own, and sink_puts_objects names the writer type instead of checking a
//! return-type-requirement: GCC then says which member a writer lacks, where it said only "'s.put(key)' does not
//! satisfy return-type-requirement".)
template <class W>
concept writer_writes = requires(W& w, std::span<const std::byte> bytes) { w.write(bytes); };
template <class W>
concept writer_commits = requires(W& w) { w.commit(); };
template <class W>
concept writer_aborts_without_throwing = requires(W& w) {
  { w.abort() } noexcept;
};
template <class W>
concept object_writer = std::move_constructible<W> && writer_writes<W> && writer_commits<W> && writer_aborts_without_throwing<W>;

template <class S>
concept opts_into_sink = requires { typename S::sink_concept; } && std::same_as<typename S::sink_concept, sink_tag>;
template <class S>
using writer_of = decltype(std::declval<S&>().put(std::declval<const std::string&>()));
template <class S>
concept sink_puts_objects = requires(S& s, const std::string& key) { s.put(key); } && object_writer<writer_of<S>>;
template <class S>
concept sink_gets_ranges = requires(S& s, const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
  { s.get(key, offset, out) } -> std::same_as<std::size_t>;
};
template <class S>
concept sink_sizes_objects = requires(S& s, const std::string& key) {
  { s.size(key) } -> std::same_as<std::optional<std::uint64_t>>;
  { s.exists(key) } -> std::same_as<bool>;
};
template <class S>
concept sink_lists_objects = requires(S& s, const std::string& prefix) {
  { s.list(prefix) } -> std::same_as<std::vector<std::string>>;
};
template <class S>
concept sink_removes_objects = requires(S& s, const std::string& key) {
  { s.remove(key) } -> std::same_as<bool>;
};

//! See the file comment for the requirements.
template <class S>
concept sink = opts_into_sink<S> && sink_puts_objects<S> && sink_gets_ranges<S> && sink_sizes_objects<S> &&
               sink_lists_objects<S> && sink_removes_objects<S>;

//! The optional batch delete of the file comment: s.remove_many(keys) for a span of keys.
template <class S>
concept sink_removes_many = sink<S> && requires(S& s, std::span<const std::string> keys) {
  { s.remove_many(keys) } -> std::same_as<void>;
};

//! Deletes every object of `keys` (a missing one is not an error): one s.remove_many(keys) where the sink has it,
//! else s.remove(key) for each key in turn (stopping at the first error).
template <sink S>
void remove_many(S& s, std::span<const std::string> keys) {
  if constexpr (sink_removes_many<S>) {
    if (!keys.empty()) s.remove_many(keys);
  } else {
    for (const auto& key : keys) s.remove(key);
  }
}

//! A temporary a sink's writer left where it writes (one that died mid-write leaves it for good): invisible to get,
//! size and list, but it takes space.
struct temporary_object {
  std::string key;  //!< where it lies: its directory's key, '/', its name
  std::uint64_t bytes = 0;
  std::chrono::system_clock::time_point modified;
};

//! The optional sweep of writers' temporaries: s.temporaries(prefix) lists those whose key starts with prefix,
//! s.remove_stale_temporaries(older_than, prefix) removes those unmodified for older_than and returns how many.
template <class S>
concept sink_keeps_temporaries = sink<S> && requires(S& s, const std::string& p, std::chrono::seconds age) {
  { s.temporaries(p) } -> std::same_as<std::vector<temporary_object>>;
  { s.remove_stale_temporaries(age, p) } -> std::same_as<std::size_t>;
};

//! s.temporaries(prefix) where the sink keeps temporaries; none otherwise (an object store's writer leaves nothing
//! a LIST does not show, or keeps it elsewhere).
template <sink S>
std::vector<temporary_object> temporaries(S& s, const std::string& prefix) {
  if constexpr (sink_keeps_temporaries<S>) return s.temporaries(prefix);
  else return {};
}
template <sink S>
std::size_t remove_stale_temporaries(S& s, std::chrono::seconds older_than, const std::string& prefix) {
  if constexpr (sink_keeps_temporaries<S>) return s.remove_stale_temporaries(older_than, prefix);
  else return 0;
}

//! The optional object identity of the file comment: s.identity(key) for an existing key.
template <class S>
concept sink_names_objects = sink<S> && requires(S& s, const std::string& key) {
  { s.identity(key) } -> std::same_as<std::string>;
};

//! s.identity(key) where the sink has it (sink_names_objects), else the key: equal for two keys of one object.
template <sink S>
std::string identity_of(S& s, const std::string& key) {
  if constexpr (sink_names_objects<S>) return s.identity(key);
  else return key;
}

//! The optional create-only put of the file comment.
template <class S>
concept sink_puts_new = sink<S> && requires(S& s, const std::string& key, std::span<const std::byte> bytes) {
  { s.put_new(key, bytes) } -> std::same_as<bool>;
};

//! The optional move of the file comment.
template <class S>
concept sink_moves = sink<S> && requires(S& s, const std::string& from, const std::string& to) {
  { s.move(from, to) } -> std::same_as<void>;
};

//! The limits of the key-limits capability (file comment); 0 is no limit.
struct sink_key_limits {
  std::size_t key_bytes = 0;        //!< the longest key the sink stores
  std::size_t component_bytes = 0;  //!< the longest '/'-separated component of a key
  std::string source;               //!< what sets them, for errors ("S3 keys are at most 1024 bytes", ...)
};

//! The optional key limits of the file comment.
template <class S>
concept sink_limits_keys = sink<S> && requires(const S& s) {
  { s.key_limits() } -> std::same_as<sink_key_limits>;
};

//! s.key_limits() where the sink has it (sink_limits_keys), else no limit.
template <sink S>
sink_key_limits key_limits_of(const S& s) {
  if constexpr (sink_limits_keys<S>) return s.key_limits();
  else return {};
}

//! Why `key` is beyond `limits` ("'KEY' is 1040 bytes, over ..."; its longest component when that is over), or empty.
inline std::string key_limit_problem(const sink_key_limits& limits, std::string_view key) {
  const auto why = [&](std::string_view what, std::size_t most) {
    return "'" + std::string(what) + "' is " + std::to_string(what.size()) + " bytes, over the " + std::to_string(most) +
           " this sink allows (" + limits.source + ")";
  };
  if (limits.key_bytes > 0 && key.size() > limits.key_bytes) return why(key, limits.key_bytes);
  if (limits.component_bytes > 0)
    for (std::size_t begin = 0; begin <= key.size();) {
      const std::size_t end = std::min(key.find('/', begin), key.size());
      if (end - begin > limits.component_bytes) return "its component " + why(key.substr(begin, end - begin), limits.component_bytes);
      begin = end + 1;
    }
  return {};
}

//! The writer type a sink's put() returns.
template <sink S>
using writer_t = decltype(std::declval<S&>().put(std::declval<const std::string&>()));

//! The optional sized put of the file comment.
template <class S>
concept sink_puts_sized = sink<S> && requires(S& s, const std::string& key, std::uint64_t size) {
  { s.put(key, size) } -> std::same_as<writer_t<S>>;
};

//! s.put(key, size) where the sink has it (sink_puts_sized), else s.put(key).
template <sink S>
writer_t<S> put_sized(S& s, const std::string& key, std::uint64_t size) {
  if constexpr (sink_puts_sized<S>) return s.put(key, size);
  else return s.put(key);
}

//! s.put_new(key, bytes) where the sink has it (sink_puts_new), else exists() then a whole put: true if it wrote.
template <sink S>
bool put_new(S& s, const std::string& key, std::span<const std::byte> bytes) {
  if constexpr (sink_puts_new<S>) {
    return s.put_new(key, bytes);
  } else {
    if (s.exists(key)) return false;
    auto w = s.put(key);
    w.write(bytes);
    w.commit();
    return true;
  }
}

//! s.move(from, to) where the sink has it (sink_moves), else a copy of `from` to `to` (get in chunks of 8 MiB, one
//! sized put) and then remove(from). errc::not_found when `from` has no object.
template <sink S>
void move_object(S& s, const std::string& from, const std::string& to) {
  if constexpr (sink_moves<S>) {
    s.move(from, to);
  } else {
    const auto n = s.size(from);
    if (!n) throw_error(errc::not_found, "no such object", {.operation = "sink.move", .object = from});
    auto w = put_sized(s, to, *n);
    std::vector<std::byte> chunk(static_cast<std::size_t>(std::min<std::uint64_t>(*n, std::uint64_t{8} << 20)));
    for (std::uint64_t at = 0; at < *n;) {
      const std::size_t got = s.get(from, at, std::span<std::byte>(chunk).first(static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), *n - at))));
      if (got == 0)
        throw_error(errc::io, "the object shrank while it was copied to " + to, {.operation = "sink.move", .object = from});
      w.write(std::span<const std::byte>(chunk).first(got));
      at += got;
    }
    w.commit();
    s.remove(from);
  }
}

namespace detail {
// Empty when the key follows the rules of the file comment, else why not. A prefix (for list) may be empty or end
// in '/', and its last component may be partial ("step-1" matches "step-10/..."), so only complete components are
// held to the rules there.
inline std::string key_problem(std::string_view key, bool is_prefix) {
  if (key.empty()) return is_prefix ? std::string{} : "a key is not empty";
  if (key.find('\0') != std::string_view::npos) return "a key holds no NUL character";
  if (key.front() == '/') return "a key is relative (no leading '/')";
  std::size_t begin = 0;
  while (begin <= key.size()) {
    std::size_t end = key.find('/', begin);
    const bool last = end == std::string_view::npos;
    if (last) end = key.size();
    const std::string_view part = key.substr(begin, end - begin);
    if (!(last && is_prefix)) {
      if (part.empty()) return "a key has no empty component (no trailing or doubled '/')";
      if (part == "." || part == "..") return "a key has no '.' or '..' component";
      if (part.starts_with(temporary_marker))
        return "a key component does not start with '" + std::string(temporary_marker) + "' (reserved for temporaries)";
    }
    if (last) break;
    begin = end + 1;
  }
  return {};
}
}  // namespace detail

//! Throws errc::invalid_argument naming the key if it breaks a rule of the file comment. User sinks call it too,
//! so every sink refuses the same keys.
inline void check_key(const std::string& key, const char* operation) {
  if (auto why = detail::key_problem(key, false); !why.empty())
    throw_error(errc::invalid_argument, why, {.operation = operation, .object = key});
}

//! The same for a list prefix: empty is fine, and the last (partial) component is not checked.
inline void check_prefix(const std::string& prefix, const char* operation) {
  if (auto why = detail::key_problem(prefix, true); !why.empty())
    throw_error(errc::invalid_argument, why, {.operation = operation, .object = prefix});
}

namespace detail {
struct writer_interface {
  virtual ~writer_interface() = default;
  virtual void write(std::span<const std::byte>) = 0;
  virtual void commit() = 0;
  virtual void abort() noexcept = 0;
};

template <class Owner, object_writer W>
struct writer_model final : writer_interface {
  std::shared_ptr<Owner> owner;  // keeps the sink alive as long as its writer
  W impl;
  writer_model(std::shared_ptr<Owner> o, W w) : owner(std::move(o)), impl(std::move(w)) {}
  void write(std::span<const std::byte> b) override { impl.write(b); }
  void commit() override { impl.commit(); }
  void abort() noexcept override { impl.abort(); }
};

struct sink_interface {
  virtual ~sink_interface() = default;
  virtual std::unique_ptr<writer_interface> put(const std::string&) = 0;
  virtual std::unique_ptr<writer_interface> put_sized(const std::string&, std::uint64_t) = 0;
  virtual std::size_t get(const std::string&, std::uint64_t, std::span<std::byte>) = 0;
  virtual std::optional<std::uint64_t> size(const std::string&) = 0;
  virtual bool exists(const std::string&) = 0;
  virtual std::vector<std::string> list(const std::string&) = 0;
  virtual bool remove(const std::string&) = 0;
  virtual void remove_many(std::span<const std::string>) = 0;
  virtual std::vector<temporary_object> temporaries(const std::string&) = 0;
  virtual std::size_t remove_stale_temporaries(std::chrono::seconds, const std::string&) = 0;
  virtual std::string identity(const std::string&) = 0;
  virtual bool put_new(const std::string&, std::span<const std::byte>) = 0;
  virtual void move(const std::string&, const std::string&) = 0;
  virtual sink_key_limits key_limits() const = 0;
};
}  // namespace detail

//! A move-only handle to any sink's writer (any_sink::put returns one). An empty one (moved from, default) throws
//! errc::closed on write and commit.
class any_object_writer {
 public:
  any_object_writer() = default;
  explicit any_object_writer(std::unique_ptr<detail::writer_interface> impl) : impl_(std::move(impl)) {}
  any_object_writer(any_object_writer&&) noexcept = default;
  any_object_writer& operator=(any_object_writer&& other) noexcept {
    if (this != &other) {
      abort();
      impl_ = std::move(other.impl_);
    }
    return *this;
  }
  ~any_object_writer() { abort(); }

  void write(std::span<const std::byte> bytes) { self("sink.write").write(bytes); }
  void commit() { self("sink.commit").commit(); }
  void abort() noexcept {
    if (impl_) impl_->abort();
  }

 private:
  detail::writer_interface& self(const char* operation) const {
    if (!impl_) throw_error(errc::closed, "use of an empty object writer", {.operation = operation});
    return *impl_;
  }
  std::unique_ptr<detail::writer_interface> impl_;
};

namespace detail {
template <sink S>
struct sink_model final : sink_interface {
  std::shared_ptr<S> impl;
  explicit sink_model(std::shared_ptr<S> s) : impl(std::move(s)) {}
  std::unique_ptr<writer_interface> put(const std::string& k) override {
    return std::make_unique<writer_model<S, writer_t<S>>>(impl, impl->put(k));
  }
  std::unique_ptr<writer_interface> put_sized(const std::string& k, std::uint64_t n) override {
    return std::make_unique<writer_model<S, writer_t<S>>>(impl, storage::put_sized(*impl, k, n));
  }
  std::size_t get(const std::string& k, std::uint64_t o, std::span<std::byte> out) override { return impl->get(k, o, out); }
  std::optional<std::uint64_t> size(const std::string& k) override { return impl->size(k); }
  bool exists(const std::string& k) override { return impl->exists(k); }
  std::vector<std::string> list(const std::string& p) override { return impl->list(p); }
  bool remove(const std::string& k) override { return impl->remove(k); }
  void remove_many(std::span<const std::string> keys) override { storage::remove_many(*impl, keys); }
  std::vector<temporary_object> temporaries(const std::string& p) override { return storage::temporaries(*impl, p); }
  std::size_t remove_stale_temporaries(std::chrono::seconds age, const std::string& p) override {
    return storage::remove_stale_temporaries(*impl, age, p);
  }
  std::string identity(const std::string& k) override { return storage::identity_of(*impl, k); }
  bool put_new(const std::string& k, std::span<const std::byte> b) override { return storage::put_new(*impl, k, b); }
  void move(const std::string& from, const std::string& to) override { storage::move_object(*impl, from, to); }
  sink_key_limits key_limits() const override { return storage::key_limits_of(*impl); }
};
}  // namespace detail

//! A copyable handle to any sink (shared ownership), so the checkpointer, the data loader and faulty_sink are not
//! templates on the sink. One virtual call per operation: nothing next to a write() or a network round trip.
class any_sink {
 public:
  using sink_concept = sink_tag;

  any_sink() = default;
  template <sink S>
    requires(!std::same_as<S, any_sink>)
  explicit any_sink(std::shared_ptr<S> s) : impl_(std::make_shared<detail::sink_model<S>>(std::move(s))) {}

  explicit operator bool() const noexcept { return impl_ != nullptr; }

  any_object_writer put(const std::string& key) { return any_object_writer(self().put(key)); }
  //! The sink's sized put, or its put(key) when it has none (sink_puts_sized).
  any_object_writer put(const std::string& key, std::uint64_t size) {
    return any_object_writer(self().put_sized(key, size));
  }
  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    return self().get(key, offset, out);
  }
  std::optional<std::uint64_t> size(const std::string& key) { return self().size(key); }
  bool exists(const std::string& key) { return self().exists(key); }
  std::vector<std::string> list(const std::string& prefix) { return self().list(prefix); }
  bool remove(const std::string& key) { return self().remove(key); }
  //! The sink's own batch delete, or remove() key by key when it has none (sink_removes_many).
  void remove_many(std::span<const std::string> keys) { self().remove_many(keys); }
  //! The sink's temporaries (sink_keeps_temporaries), or none.
  std::vector<temporary_object> temporaries(const std::string& prefix) { return self().temporaries(prefix); }
  std::size_t remove_stale_temporaries(std::chrono::seconds older_than, const std::string& prefix) {
    return self().remove_stale_temporaries(older_than, prefix);
  }
  //! The sink's object identity (sink_names_objects), or the key.
  std::string identity(const std::string& key) { return self().identity(key); }
  //! The sink's create-only put, or exists() then a put when it has none (sink_puts_new).
  bool put_new(const std::string& key, std::span<const std::byte> bytes) { return self().put_new(key, bytes); }
  //! The sink's move, or a copy then remove(from) when it has none (sink_moves).
  void move(const std::string& from, const std::string& to) { self().move(from, to); }
  //! The sink's key limits (sink_limits_keys), or none.
  sink_key_limits key_limits() const { return self().key_limits(); }

 private:
  detail::sink_interface& self() const {
    if (!impl_) throw_error(errc::invalid_argument, "use of an empty any_sink");
    return *impl_;
  }
  std::shared_ptr<detail::sink_interface> impl_;
};

template <sink S, class... Args>
any_sink make_sink(Args&&... args) {
  return any_sink(std::make_shared<S>(std::forward<Args>(args)...));
}

//! Writes a whole object in one put (small objects: an index, metadata).
template <sink S>
void put_object(S& s, const std::string& key, std::span<const std::byte> bytes) {
  auto w = s.put(key);
  w.write(bytes);
  w.commit();
}

inline std::span<const std::byte> as_bytes(std::string_view text) noexcept {
  return std::as_bytes(std::span<const char>(text.data(), text.size()));
}

//! Reads a whole object: errc::not_found if absent. Not atomic against a concurrent replacement of the same key
//! (size, then get); the checkpointer never replaces an object.
template <sink S>
std::vector<std::byte> get_object(S& s, const std::string& key) {
  const auto n = s.size(key);
  if (!n) throw_error(errc::not_found, "no such object", {.operation = "sink.get", .object = key});
  std::vector<std::byte> out(static_cast<std::size_t>(*n));
  out.resize(s.get(key, 0, out));
  return out;
}

}  // namespace shardkit::storage
