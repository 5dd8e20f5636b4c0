#pragma once
//! A sink over an S3-compatible object store (AWS S3, MinIO, Ceph RGW, IBM COS, s3rver), through libcurl; link
//! shardkit::s3. Location `s3://bucket/prefix`: key "step-100/rank-3.safetensors" is the object
//! "prefix/step-100/rank-3.safetensors" of the bucket. Configuration: storage/s3/config.hpp and docs/s3.md.
//!
//! **put** buffers up to part_size bytes. An object that fits is one PutObject at commit. A larger one becomes a
//! multipart upload: CreateMultipartUpload when the first part is full, then each full part is sent by the sink's
//! worker threads (up to `parallel` parts of a writer in flight, each over a reused connection), while write()
//! keeps filling the next part; commit sends the last part, waits for all, and CompleteMultipartUpload makes the
//! object visible at once. That is what makes S3 a sink: nothing exists under the key until Complete succeeds, so
//! a reader never sees a partial object and a writer that dies leaves only an invisible pending upload. A failed
//! part (after its retries), a failed commit and abort() all issue AbortMultipartUpload, so a failed save leaves
//! no parts behind. A writer killed outright cannot: its pending upload is the sink's temporary (temporaries(),
//! remove_stale_temporaries(): sink_keeps_temporaries), which the checkpointer and `shardkit-ckpt gc` sweep as they
//! sweep posix_sink's; abort_pending_uploads() and a bucket lifecycle rule "AbortIncompleteMultipartUpload" clear
//! them too. Memory per writer: at most (parallel + 1) * part_size.
//!
//! **Ambiguous commit.** If CompleteMultipartUpload's reply is lost and the retry finds the upload gone
//! (NoSuchUpload), the first attempt succeeded: after a retried Complete fails, commit checks whether the key holds
//! an object of the written size and then returns. A PutObject retried after a lost reply simply writes the
//! same bytes again.
//!
//! **get** is one ranged GET; a read larger than part_size is cut into part_size ranges fetched in parallel.
//! **size/exists** are HEAD. **list** is ListObjectsV2 with continuation tokens (keys under the prefix, the prefix
//! removed, sorted byte-wise as S3 returns them). **remove** is HEAD + DeleteObject (S3's DELETE does not say
//! whether the object existed); **remove_objects** deletes up to 1000 keys per DeleteObjects request, and is the
//! sink's remove_many (sink_removes_many), through which ckpt::apply_retention deletes old checkpoints.
//!
//! **Consistency.** AWS S3 has had strong read-after-write consistency for PUT, DELETE and LIST since December
//! 2020; other stores may list or read a new object late. The sink never relies on LIST or on an order between
//! objects: the checkpointer names every object of a checkpoint in its index, written last (docs/s3.md).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/storage/s3/config.hpp"
#include "shardkit/storage/s3/detail/client.hpp"
#include "shardkit/storage/s3/detail/multipart.hpp"
#include "shardkit/storage/s3/detail/writer.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::storage {

//! A multipart upload that was started and neither completed nor aborted (s3_sink::pending_uploads).
struct s3_pending_upload {
  std::string key;  //!< the sink key (the sink's prefix removed)
  std::string upload_id;
  std::chrono::system_clock::time_point initiated;  //!< the server's clock (ListMultipartUploads' Initiated)
};

class s3_sink {
 public:
  using sink_concept = sink_tag;

  //! An object being written (put()): write() its bytes in any pieces, then commit() makes it visible at once, or
  //! abort() (or the destructor) drops it; both end the writer. Move-only.
  class writer {
   public:
    writer(writer&&) noexcept = default;
    //! Aborts what this writer held, then takes `o`'s object.
    writer& operator=(writer&&) noexcept = default;
    ~writer() = default;  // aborts an object neither committed nor aborted

    //! Appends bytes; a full part is sent while the next fills. After a failure every write and commit throws
    //! errc::aborted and the upload is aborted.
    void write(std::span<const std::byte> bytes) { object_.write(bytes); }
    //! Makes the object visible under its key (PutObject, or the last part and CompleteMultipartUpload).
    void commit() { object_.commit(); }
    //! Drops the object: AbortMultipartUpload of a started upload (best effort). No-op once finished.
    void abort() noexcept { object_.abort(); }
    //! Bytes written so far.
    std::uint64_t bytes_written() const noexcept { return object_.bytes_written(); }

   private:
    friend class s3_sink;
    writer(std::shared_ptr<detail::s3::client> client, std::string key, std::size_t part_size)
        : object_(std::move(client), std::move(key), part_size) {}

    detail::s3::object_writer object_;
  };

  //! The sink of `location`; options default to s3_options::from_env(), and endpoint, region and credentials left
  //! empty are taken from the environment (errc::config when there are no credentials). Sends no request.
  explicit s3_sink(s3_location location, s3_options options = s3_options::from_env())
      : client_(std::make_shared<detail::s3::client>(std::move(location), std::move(options))) {}
  //! From an "s3://bucket/prefix" string.
  explicit s3_sink(std::string_view location, s3_options options = s3_options::from_env())
      : s3_sink(parse_s3_location(location), std::move(options)) {}

  const s3_location& location() const noexcept { return client_->location(); }
  //! The resolved options (endpoint, region filled in). Holds the credentials: do not print it.
  const s3_options& options() const noexcept { return client_->options(); }

  writer put(const std::string& key) {
    check_put_key(key);
    return writer(client_, key, client_->options().part_size);
  }
  //! put() of an object that will have `size` bytes (sink_puts_sized): its parts grow past part_size where
  //! part_size would need more than max_parts of them, to ceil(size / max_parts) (a 600 GB object in 10,000
  //! parts: 60 MB each; memory per writer grows with them). errc::invalid_argument past S3's 5 TiB per object.
  writer put(const std::string& key, std::uint64_t size) {
    check_put_key(key);
    if (size > s3_max_object_size)
      throw_error(errc::invalid_argument,
                  "S3 " + client_->url_of(client_->full_key(key)) + ": " + std::to_string(size) +
                      " bytes is over S3's 5 TiB per object",
                  {.operation = "sink.put", .object = key});
    const std::uint64_t most = client_->options().max_parts;
    const std::uint64_t fitting = (size + most - 1) / most;
    return writer(client_, key, static_cast<std::size_t>(std::max<std::uint64_t>(client_->options().part_size, fitting)));
  }

  //! Writes a small object only if the key has none (sink_puts_new): one PutObject with If-None-Match: *, which S3
  //! (since 2024), MinIO and Ceph refuse with 412 when the key exists. A server that ignores the header (s3rver,
  //! older stores) replaces the object and this returns true: callers that need the guarantee read it back.
  bool put_new(const std::string& key, std::span<const std::byte> bytes) {
    check_put_key(key);
    auto& c = *client_;
    detail::s3::request r{.operation = "PutObject", .method = "PUT", .key = c.full_key(key), .body = bytes,
                         .headers = {"If-None-Match: *"}};
    auto resp = c.execute(r);
    // 409: another conditional PUT of the key is in flight (S3's ConditionalRequestConflict); it will exist.
    if (resp.curl == CURLE_OK && (resp.status == 412 || resp.status == 409)) return false;
    if (!resp.ok()) c.fail(resp, r, "sink.put", key);
    return true;
  }

  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    check_key(key, "sink.get");
    auto& c = *client_;
    if (out.empty()) {
      if (!size(key)) throw_error(errc::not_found, "no such object", {.operation = "sink.get", .object = key});
      return 0;
    }
    const std::size_t chunk = c.options().part_size;
    if (out.size() <= chunk || c.options().parallel == 1) return get_range(key, offset, out);
    // Ranges of part_size, all but the first on the workers; the counts add up to the first short range.
    const std::size_t n = (out.size() + chunk - 1) / chunk;
    struct shared {
      std::mutex mutex;
      std::condition_variable done;
      std::size_t left;
      std::vector<std::size_t> received;
      std::vector<std::exception_ptr> errors;
    } state{.left = n - 1, .received = std::vector<std::size_t>(n), .errors = std::vector<std::exception_ptr>(n)};
    const auto slice = [&](std::size_t i) { return out.subspan(i * chunk, std::min(chunk, out.size() - i * chunk)); };
    for (std::size_t i = 1; i < n; ++i)
      c.post_work([this, &state, &slice, &key, offset, chunk, i] {
        std::size_t got = 0;
        std::exception_ptr error;
        try {
          got = get_range(key, offset + i * chunk, slice(i));
        } catch (...) {
          error = std::current_exception();
        }
        std::lock_guard lock(state.mutex);
        state.received[i] = got;
        state.errors[i] = error;
        if (--state.left == 0) state.done.notify_all();
      });
    try {
      state.received[0] = get_range(key, offset, slice(0));
    } catch (...) {
      state.errors[0] = std::current_exception();
    }
    {
      std::unique_lock wait(state.mutex);
      state.done.wait(wait, [&] { return state.left == 0; });
    }
    std::size_t total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (state.errors[i]) std::rethrow_exception(state.errors[i]);
      total += state.received[i];
      if (state.received[i] < slice(i).size()) break;
    }
    return total;
  }

  std::optional<std::uint64_t> size(const std::string& key) {
    check_key(key, "sink.size");
    return head(key, "sink.size");
  }
  bool exists(const std::string& key) {
    check_key(key, "sink.exists");
    return head(key, "sink.exists").has_value();
  }

  //! The object identity of the sink concept (sink_names_objects): its path-style address,
  //! `<endpoint>/<bucket>/<prefix><key>`, so that one key on two endpoints or buckets names two objects. No request.
  std::string identity(const std::string& key) {
    check_key(key, "sink.identity");
    const auto& c = *client_;
    std::string endpoint = c.options().endpoint;
    while (endpoint.ends_with('/')) endpoint.pop_back();
    return endpoint + "/" + c.location().bucket + "/" + c.full_key(key);
  }

  std::vector<std::string> list(const std::string& prefix) {
    check_prefix(prefix, "sink.list");
    auto& c = *client_;
    const std::string& root = c.location().prefix;
    std::vector<std::string> keys;
    std::string token;
    do {
      // The canonical query: parameters sorted by name.
      std::string query;
      if (!token.empty()) query += "continuation-token=" + detail::s3::uri_encode(token, false) + "&";
      query += "list-type=2&max-keys=" + std::to_string(list_page_size_);
      const std::string full = root + prefix;
      if (!full.empty()) query += "&prefix=" + detail::s3::uri_encode(full, false);
      detail::s3::request r{.operation = "ListObjectsV2", .about = full, .query = query};
      auto resp = c.execute(r);
      if (!resp.ok()) c.fail(resp, r, "sink.list", prefix);
      for (auto& k : detail::s3::xml_values(resp.text, "Key")) {
        if (!k.starts_with(root)) continue;
        std::string key = k.substr(root.size());
        if (detail::key_problem(key, false).empty()) keys.push_back(std::move(key));  // others are not sink keys
      }
      if (detail::s3::xml_value(resp.text, "IsTruncated") != "true") break;
      token = detail::s3::xml_value(resp.text, "NextContinuationToken");
      // Stopping here would return a listing with keys missing and no word: retention and latest() trust it.
      if (token.empty())
        throw_error(errc::io,
                    "S3 ListObjectsV2 " + c.url_of(full) + ": the server said the listing goes on (IsTruncated) but "
                    "gave no NextContinuationToken, after " + std::to_string(keys.size()) + " keys",
                    {.operation = "sink.list", .object = prefix});
    } while (true);
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  bool remove(const std::string& key) {
    check_key(key, "sink.remove");
    if (!head(key, "sink.remove")) return false;
    auto& c = *client_;
    detail::s3::request r{.operation = "DeleteObject", .method = "DELETE", .key = c.full_key(key)};
    auto resp = c.execute(r);
    if (!resp.ok() && resp.status != 404) c.fail(resp, r, "sink.remove", key);
    return true;
  }

  //! Deletes many objects with DeleteObjects (up to 1000 keys per request): retention of old checkpoints. A
  //! missing key is not an error. errc::io naming the first key S3 could not delete.
  void remove_objects(std::span<const std::string> keys) {
    for (const auto& k : keys) check_key(k, "sink.remove_objects");
    auto& c = *client_;
    for (std::size_t begin = 0; begin < keys.size(); begin += 1000) {
      const auto batch = keys.subspan(begin, std::min<std::size_t>(1000, keys.size() - begin));
      std::string xml = "<Delete><Quiet>true</Quiet>";
      for (const auto& k : batch) xml += "<Object><Key>" + detail::s3::xml_escape(c.full_key(k)) + "</Key></Object>";
      xml += "</Delete>";
      const auto digest = detail::s3::md5(as_bytes(xml));
      detail::s3::request r{.operation = "DeleteObjects", .method = "POST", .query = "delete=", .body = as_bytes(xml),
                           .headers = {"Content-Type: application/xml", "Content-MD5: " + detail::s3::base64(digest)}};
      auto resp = c.execute(r);
      if (!resp.ok()) c.fail(resp, r, "sink.remove_objects", batch.front());
      for (const auto& e : detail::s3::xml_blocks(resp.text, "Error")) {
        const std::string full = detail::s3::xml_value(e, "Key");
        throw_error(errc::io,
                    c.scrub("S3 DeleteObjects " + c.url_of(full) + ": " + detail::s3::xml_value(e, "Code") + " (" +
                            detail::s3::xml_value(e, "Message") + ")"),
                    {.operation = "sink.remove_objects", .object = full.substr(std::min(full.size(), c.location().prefix.size()))});
      }
    }
  }

  //! The batch delete of the sink concept (sink_removes_many): remove_objects.
  void remove_many(std::span<const std::string> keys) { remove_objects(keys); }

  //! Multipart uploads under `prefix` (of this sink's keys) that were started and never completed or aborted:
  //! what writers killed mid-upload leave (invisible, but billed). ListMultipartUploads, all pages.
  std::vector<s3_pending_upload> pending_uploads(const std::string& prefix = {}) {
    check_prefix(prefix, "sink.pending_uploads");
    std::vector<s3_pending_upload> out;
    detail::s3::for_each_pending_upload(*client_, prefix, [&](std::string key, std::string id, auto initiated) {
      out.push_back({std::move(key), std::move(id), initiated});
    });
    return out;
  }

  //! Aborts every pending upload under `prefix`; returns how many. Only while no writer of this prefix is live
  //! (it would abort that writer's upload, and its commit would then fail: nothing partial becomes visible).
  std::size_t abort_pending_uploads(const std::string& prefix = {}) {
    std::size_t n = 0;
    for (const auto& u : pending_uploads(prefix)) {
      detail::s3::abort_multipart(*client_, client_->full_key(u.key), u.upload_id);
      ++n;
    }
    return n;
  }

  //! The pending uploads under `prefix` as the temporaries of sink_keeps_temporaries (what a writer killed
  //! mid-upload leaves): each one's key (the object's), the bytes of its parts and its last modification, the newest
  //! of its initiation and its parts' (ListParts per upload: a live writer keeps adding parts, as a posix_sink writer
  //! keeps touching its temporary). An upload completed or aborted meanwhile is left out.
  std::vector<temporary_object> temporaries(const std::string& prefix = {}) {
    std::vector<temporary_object> out;
    for (const auto& u : pending_uploads(prefix))
      if (auto t = detail::s3::pending_upload_parts(*client_, u.key, u.upload_id, u.initiated)) out.push_back(std::move(*t));
    return out;
  }

  //! Aborts the pending uploads under `prefix` whose last modification (temporaries()) is at least `older_than` ago;
  //! returns how many. A live writer's upload aborted anyway fails at its commit: nothing partial becomes visible.
  std::size_t remove_stale_temporaries(std::chrono::seconds older_than, const std::string& prefix = {}) {
    const auto now = std::chrono::system_clock::now();
    std::size_t n = 0;
    for (const auto& u : pending_uploads(prefix)) {
      const auto t = older_than.count() > 0 ? detail::s3::pending_upload_parts(*client_, u.key, u.upload_id, u.initiated)
                                            : std::optional<temporary_object>(temporary_object{});
      if (!t || now - t->modified < older_than) continue;
      detail::s3::abort_multipart(*client_, client_->full_key(u.key), u.upload_id);
      ++n;
    }
    return n;
  }

  //! S3's 1,024 bytes per key, less the sink's prefix (sink_limits_keys); no limit per component.
  sink_key_limits key_limits() const {
    const std::string& prefix = client_->location().prefix;
    return {.key_bytes = s3_max_key_bytes - std::min(prefix.size(), s3_max_key_bytes),
            .source = "S3 keys are at most " + std::to_string(s3_max_key_bytes) + " bytes" +
                      (prefix.empty() ? std::string{}
                                      : ", and this sink's prefix '" + prefix + "' takes " + std::to_string(prefix.size()) + " of them")};
  }

  //! The page size of list() (S3's max-keys, at most 1000): small values exercise pagination in tests.
  void set_list_page_size(unsigned n) noexcept { list_page_size_ = std::clamp(n, 1u, 1000u); }

 private:
  // The sink's key rules, and S3's 1,024 bytes per key (the sink's prefix included), checked before anything is
  // sent: S3 would refuse it (KeyTooLongError) only once the data went up.
  void check_put_key(const std::string& key) const {
    check_key(key, "sink.put");
    const std::string full = client_->full_key(key);
    if (full.size() > s3_max_key_bytes)
      throw_error(errc::invalid_argument,
                  "an S3 key has at most 1024 bytes; this one (the prefix '" + client_->location().prefix +
                      "' included) has " + std::to_string(full.size()),
                  {.operation = "sink.put", .object = key});
  }

  // HEAD: the size, or nullopt on 404. A 404 the first time is checked against the bucket once (HeadBucket), so
  // that a misspelled bucket is an error, not an empty store.
  std::optional<std::uint64_t> head(const std::string& key, const char* operation) {
    auto& c = *client_;
    detail::s3::request r{.operation = "HeadObject", .method = "HEAD", .key = c.full_key(key)};
    auto resp = c.execute(r);
    if (resp.ok()) return resp.content_length.value_or(0);
    if (resp.curl != CURLE_OK || resp.status != 404) c.fail(resp, r, operation, key);
    check_bucket(operation, key);
    return std::nullopt;
  }

  void check_bucket(const char* operation, const std::string& key) {
    if (bucket_checked_->load(std::memory_order_acquire)) return;
    auto& c = *client_;
    // ListObjectsV2 of one key rather than HeadBucket: its error has a body, so the code (NoSuchBucket) shows.
    // Its error names the location as given (s3://bucket/prefix/): the prefix is what the user typed.
    detail::s3::request r{.operation = "ListObjectsV2", .about = c.location().prefix, .query = "list-type=2&max-keys=1"};
    auto resp = c.execute(r);
    if (!resp.ok()) c.fail(resp, r, operation, key);
    bucket_checked_->store(true, std::memory_order_release);
  }

  std::size_t get_range(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    auto& c = *client_;
    detail::s3::request r{.operation = "GetObject", .key = c.full_key(key), .into = out, .range_begin = offset};
    auto resp = c.execute(r);
    if (resp.ok()) return resp.received;
    if (resp.curl == CURLE_OK && resp.status == 416) return 0;  // at or past the end
    if (resp.curl == CURLE_OK && resp.status == 404 && resp.code() != "NoSuchBucket")
      throw_error(errc::not_found, "no such object (" + c.url_of(r.key) + ")", {.operation = "sink.get", .object = key});
    c.fail(resp, r, "sink.get", key);
  }

  std::shared_ptr<detail::s3::client> client_;
  unsigned list_page_size_ = 1000;
  std::shared_ptr<std::atomic<bool>> bucket_checked_ = std::make_shared<std::atomic<bool>>(false);
};

static_assert(sink<s3_sink> && sink_removes_many<s3_sink> && sink_limits_keys<s3_sink> && sink_puts_sized<s3_sink> && sink_puts_new<s3_sink> &&
              sink_keeps_temporaries<s3_sink>);

}  // namespace shardkit::storage
