#pragma once
// The object writer of s3_sink (s3_sink::writer is this, behind the public header): a part buffer filled by
// write(), one PutObject at commit for an object that fits one part, otherwise a multipart upload whose full parts
// go to the client's worker threads (at most `parallel` in flight per writer) while write() fills the next one. Part
// buffers are reused: a writer takes one from the client, gets the sent ones back from the workers, and returns them
// all to the client when it finishes, for the sink's next writer. s3_sink.hpp documents the guarantees (nothing is
// visible before Complete; a failure aborts the upload; an ambiguous Complete is checked with a HEAD).
#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/storage/s3/detail/client.hpp"
#include "shardkit/storage/s3/detail/multipart.hpp"
#include "shardkit/storage/s3/detail/text.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::storage::detail::s3 {

class object_writer {
 public:
  //! Writes the sink key `key` (its full key: the sink's prefix added) in parts of `part_size` bytes.
  object_writer(std::shared_ptr<client> client, std::string key, std::size_t part_size)
      : client_(std::move(client)), key_(std::move(key)), full_key_(client_->full_key(key_)), part_size_(part_size) {}
  object_writer(object_writer&& o) noexcept
      : client_(std::move(o.client_)), key_(std::move(o.key_)), full_key_(std::move(o.full_key_)),
        buffer_(std::move(o.buffer_)), upload_(std::move(o.upload_)), upload_id_(std::move(o.upload_id_)),
        part_size_(o.part_size_), parts_(o.parts_), total_(o.total_), failed_(o.failed_) {}
  object_writer& operator=(object_writer&& o) noexcept {
    if (this != &o) {
      abort();
      client_ = std::move(o.client_);
      key_ = std::move(o.key_);
      full_key_ = std::move(o.full_key_);
      buffer_ = std::move(o.buffer_);
      upload_ = std::move(o.upload_);
      upload_id_ = std::move(o.upload_id_);
      part_size_ = o.part_size_;
      parts_ = o.parts_;
      total_ = o.total_;
      failed_ = o.failed_;
    }
    return *this;
  }
  ~object_writer() { abort(); }

  void write(std::span<const std::byte> bytes) {
    check_open("sink.write");
    if (failed_)
      throw_error(errc::aborted, "an earlier write failed; this object will not be committed",
                  {.operation = "sink.write", .object = key_});
    const std::size_t part = part_size_;
    try {
      while (!bytes.empty()) {
        if (buffer_.capacity() == 0) buffer_ = client_->take_part_buffer();
        if (buffer_.capacity() < part) buffer_.reserve(part);
        const std::size_t n = std::min(bytes.size(), part - buffer_.size());
        buffer_.insert(buffer_.end(), bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
        bytes = bytes.subspan(n);
        total_ += n;
        if (buffer_.size() == part) send_part();
      }
    } catch (...) {
      failed_ = true;
      abort_upload();
      throw;
    }
  }

  void commit() {
    check_open("sink.commit");
    auto client = client_;
    if (failed_) {
      abort();
      throw_error(errc::aborted, "an earlier write failed; nothing was committed",
                  {.operation = "sink.commit", .object = key_});
    }
    try {
      if (!upload_) {
        request r{.operation = "PutObject", .method = "PUT", .key = full_key_, .body = buffer_};
        auto resp = client->execute(r);
        if (!resp.ok()) client->fail(resp, r, "sink.commit", key_);
      } else {
        if (!buffer_.empty()) send_part();
        wait_parts(0);
        complete();
      }
    } catch (...) {
      abort();
      throw;
    }
    finish();
  }

  void abort() noexcept {
    if (!client_) return;
    abort_upload();
    finish();
  }

  //! Bytes written so far.
  std::uint64_t bytes_written() const noexcept { return total_; }

 private:
  // What the worker threads share with the writer while parts are in flight.
  struct upload_state {
    std::mutex mutex;
    std::condition_variable changed;
    unsigned in_flight = 0;
    std::vector<std::string> etags;  // by part number - 1
    std::exception_ptr error;
    std::vector<std::vector<std::byte>> spare;  // part buffers back from the workers, reused
  };


  void check_open(const char* operation) const {
    if (!client_)
      throw_error(errc::closed, "the writer was already committed or aborted", {.operation = operation, .object = key_});
  }

  void finish() noexcept {
    if (client_) {  // the part buffers go back to the sink for its next writer
      client_->keep_part_buffer(std::move(buffer_));
      if (upload_) {
        std::lock_guard lock(upload_->mutex);
        if (upload_->in_flight == 0)
          for (auto& b : upload_->spare) client_->keep_part_buffer(std::move(b));
      }
    }
    client_.reset();
    buffer_ = {};
    upload_.reset();
  }

  // Waits until at most `most` parts are in flight; rethrows a part's error.
  void wait_parts(unsigned most) {
    std::unique_lock lock(upload_->mutex);
    upload_->changed.wait(lock, [&] { return upload_->in_flight <= most || upload_->error; });
    if (upload_->error) {
      auto e = upload_->error;
      lock.unlock();
      std::rethrow_exception(e);
    }
  }

  void send_part() {
    auto& client = *client_;
    const std::uint64_t most = client.options().max_parts;
    if (static_cast<std::uint64_t>(parts_) >= most)
      throw_error(errc::invalid_argument,
                  "S3 " + client.url_of(full_key_) + ": the object outgrew the " + std::to_string(most) +
                      " parts S3 allows an upload, of " + std::to_string(part_size_) + " bytes each (" +
                      std::to_string(total_) + " bytes written); nothing is committed. Give put() the "
                      "object's size, or raise SHARDKIT_S3_PART_SIZE (s3_options::part_size)",
                  {.operation = "sink.write", .object = key_});
    if (!upload_) {
      request r{.operation = "CreateMultipartUpload", .method = "POST", .key = full_key_, .query = "uploads="};
      auto resp = client.execute(r);
      upload_id_ = xml_value(resp.text, "UploadId");
      if (!resp.ok() || upload_id_.empty()) client.fail(resp, r, "sink.write", key_);
      upload_ = std::make_shared<upload_state>();
    }
    wait_parts(client.options().parallel - 1);
    const int number = ++parts_;
    std::vector<std::byte> part;
    {
      std::lock_guard lock(upload_->mutex);
      upload_->etags.resize(static_cast<std::size_t>(number));
      ++upload_->in_flight;
      if (!upload_->spare.empty()) {
        part = std::move(upload_->spare.back());
        upload_->spare.pop_back();
      }
    }
    part.clear();
    std::swap(part, buffer_);  // the full part goes; an emptied earlier one is filled next
    // The worker holds the state (shared) and the client (raw: this writer outlives its parts, since commit and
    // abort wait for all of them before letting the client go).
    client.post_work([c = &client, state = upload_, part = std::move(part), number, full_key = full_key_,
                           key = key_, id = upload_id_]() mutable {
      std::exception_ptr error;
      std::string etag;
      try {
        request r{.operation = "UploadPart", .method = "PUT", .key = full_key,
                             .query = "partNumber=" + std::to_string(number) + "&uploadId=" + uri_encode(id, false),
                             .body = part};
        auto resp = c->execute(r);
        if (!resp.ok() || resp.etag.empty()) c->fail(resp, r, "sink.write", key);
        etag = std::move(resp.etag);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(state->mutex);
      if (error && !state->error) state->error = error;
      state->etags[static_cast<std::size_t>(number) - 1] = std::move(etag);
      state->spare.push_back(std::move(part));
      --state->in_flight;
      state->changed.notify_all();
    });
  }

  void complete() {
    auto& client = *client_;
    std::string xml = "<CompleteMultipartUpload>";
    for (std::size_t i = 0; i < upload_->etags.size(); ++i)
      xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" +
             xml_escape(upload_->etags[i]) + "</ETag></Part>";
    xml += "</CompleteMultipartUpload>";
    request r{.operation = "CompleteMultipartUpload", .method = "POST", .key = full_key_,
                         .query = "uploadId=" + uri_encode(upload_id_, false), .body = as_bytes(xml),
                         .headers = {"Content-Type: application/xml"}, .error_in_ok = true};
    auto resp = client.execute(r);
    if (resp.ok()) {
      upload_id_.clear();  // nothing left to abort
      return;
    }
    // A lost reply to an attempt that succeeded: the retry finds the upload gone (S3 says NoSuchUpload; some
    // servers fail otherwise). The object of our size under the key is ours (the checkpointer never writes a key
    // twice).
    if (resp.attempts > 1) {
      request head{.operation = "HeadObject", .method = "HEAD", .key = full_key_};
      auto h = client.execute(head);
      if (h.ok() && h.content_length == total_) {
        upload_id_.clear();
        return;
      }
    }
    client.fail(resp, r, "sink.commit", key_);
  }

  // Waits for the parts in flight, then AbortMultipartUpload (best effort: its own failure is only logged, and a
  // lifecycle rule or abort_pending_uploads() clears what it could not).
  void abort_upload() noexcept {
    if (!upload_ || upload_id_.empty()) return;
    {
      std::unique_lock lock(upload_->mutex);
      upload_->changed.wait(lock, [&] { return upload_->in_flight == 0; });
    }
    try {
      abort_multipart(*client_, full_key_, upload_id_);
    } catch (const std::exception& e) {
      log::warn("s3_sink: could not abort the multipart upload of '", key_, "': ", e.what());
    }
    upload_id_.clear();
  }

  std::shared_ptr<client> client_;  // null once finished
  std::string key_;
  std::string full_key_;
  std::vector<std::byte> buffer_;
  std::shared_ptr<upload_state> upload_;  // null until the first part is sent
  std::string upload_id_;                 // empty when there is nothing to abort
  std::size_t part_size_;
  int parts_ = 0;
  std::uint64_t total_ = 0;
  bool failed_ = false;
};

}  // namespace shardkit::storage::detail::s3
