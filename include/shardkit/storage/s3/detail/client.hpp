#pragma once
// The S3 sink's HTTP layer over libcurl: one request signed by libcurl's own SigV4 (CURLOPT_AWS_SIGV4), a pool of
// easy handles so that connections are reused, the retry policy, and the error text. Private: s3_sink.hpp is the API.
//
// Retries: a transport failure (refused, reset, timed out, stalled, a truncated reply), a reply whose S3 error code
// says "try again" (retryable_code: InternalError, SlowDown, RequestTimeout, ServiceUnavailable, throttling), and
// HTTP 500/502/503/504/429 without a code (a HEAD's error has no body; a proxy's has no S3 code) are retried up to
// max_attempts with "full jitter" backoff (a uniform wait in [0, min(cap, base * 2^n)]), which spreads a fleet of
// ranks hitting one SlowDown apart instead of retrying in lock step. A connection the endpoint refuses or cannot
// be reached (curl 7) gets at most connect_error_attempts of them, as boto3's standard mode retries a connection
// error (3 attempts): a server restarting is back within a few hundred ms; a closed port or a wrong one stays
// closed, and eight tries cost seconds per rank. Everything else (403 wrong credentials, 404
// NoSuchBucket, 400, a 5xx with a final code such as 501 NotImplemented, an unknown host, TLS to a plain-http port)
// is reported at once: retrying cannot fix it, and a checkpoint of 1000 ranks must not turn one typo into a retry
// storm.
#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"
#include "shardkit/core/link_governor.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/storage/s3/config.hpp"
#include "shardkit/storage/s3/detail/governed_socket.hpp"
#include "shardkit/storage/s3/detail/resolve.hpp"
#include "shardkit/storage/s3/detail/text.hpp"

namespace shardkit::storage::detail::s3 {

inline void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct easy_deleter {
  void operator()(CURL* c) const noexcept { curl_easy_cleanup(c); }
};
using easy_ptr = std::unique_ptr<CURL, easy_deleter>;

struct request {
  const char* operation = "GetObject";  // the S3 API name, for errors
  const char* method = "GET";
  std::string key;    // the object's key in the bucket (the sink's prefix included); empty: the bucket itself
  std::string about;  // for errors, when not `key`: the prefix a listing reads (the sink's prefix included)
  std::string query;  // canonical: sorted by name, values encoded, "name=" for flags
  std::span<const std::byte> body;
  std::vector<std::string> headers;
  std::span<std::byte> into;                 // GET: the object's bytes go here
  std::optional<std::uint64_t> range_begin;  // GET: "Range: bytes=b-(b+into.size()-1)"
  bool error_in_ok = false;                  // CompleteMultipartUpload: a 200 may carry an <Error>
  const std::string& subject() const { return about.empty() ? key : about; }
};

struct response {
  long status = 0;
  std::string text;          // the body when it is not the object's bytes (XML, an error)
  std::size_t received = 0;  // bytes written into request::into
  std::string etag;
  std::optional<std::uint64_t> content_length;
  CURLcode curl = CURLE_OK;
  std::string curl_error;
  long os_errno = 0;  // the socket's errno when the transport failed (ECONNREFUSED: nothing listens there)
  unsigned attempts = 0;
  bool empty_object = false;  // a Content-Range said the object has no bytes
  bool error_body = false;    // a 2xx whose body is an <Error> (CompleteMultipartUpload may answer so)
  std::string code() const { return xml_value(text, "Code"); }
  bool ok() const { return curl == CURLE_OK && status >= 200 && status < 300 && !error_body; }
};

//! Attempts for a connection the endpoint refused or that could not be made (curl 7), at most max_attempts.
inline constexpr unsigned connect_error_attempts = 3;

inline bool transient(CURLcode c) noexcept {
  switch (c) {
    // Not CURLE_COULDNT_RESOLVE_HOST (a misspelled endpoint) or CURLE_SSL_CONNECT_ERROR (https to a plain-http
    // port, a certificate refused): the same request gets the same answer, and eight tries cost seconds per rank.
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_SEND_FAIL_REWIND:
      return true;
    default:
      return false;
  }
}

// The S3 error codes that mean "the same request may succeed later" (the AWS SDKs' transient and throttling codes).
inline bool retryable_code(std::string_view code) noexcept {
  for (std::string_view c : {"InternalError", "SlowDown", "RequestTimeout", "ServiceUnavailable", "Throttling",
                             "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
                             "BandwidthLimitExceeded", "TooManyRequestsException", "OperationAborted",
                             "PriorRequestNotComplete"})
    if (code == c) return true;
  return false;
}

inline bool retriable(const response& r) {
  if (r.curl != CURLE_OK) return transient(r.curl);
  if (r.ok()) return false;
  const std::string code = r.code();
  if (!code.empty()) return retryable_code(code);
  return r.status == 500 || r.status == 502 || r.status == 503 || r.status == 504 || r.status == 429;
}

// One per sink: the resolved configuration, idle easy handles (each keeps its connection alive), the worker threads
// that send parts and ranges in parallel.
class client {
 public:
  client(s3_location location, s3_options options)
      : location_(std::move(location)), options_(resolve(std::move(options))),
        base_url_(bucket_url(options_.endpoint, location_.bucket, options_.addressing)),
        virtual_hosted_(!base_url_.ends_with("/" + location_.bucket)) {
    check_endpoint_path(options_.endpoint, location_.bucket);
    global_init();
    sigv4_ = "aws:amz:" + options_.region + ":s3";
  }
  ~client() { pool_.reset(); }  // joins the workers before the handles go

  const s3_location& location() const noexcept { return location_; }
  const s3_options& options() const noexcept { return options_; }
  const std::string& base_url() const noexcept { return base_url_; }
  std::string full_key(const std::string& key) const { return location_.prefix + key; }
  std::string url_of(const std::string& full_key) const { return "s3://" + location_.bucket + "/" + full_key; }

  // Part buffers of finished uploads, kept for the sink's next writer: uploads every few steps (a checkpointer's)
  // then fill memory already in place instead of mapping, faulting in and zeroing fresh pages each time (glibc maps
  // a buffer of part size anew on every allocation: the largest avoidable part of a save's CPU, measured). At most
  // parallel + 1 are kept, one writer's peak; a taken one is empty (its capacity kept).
  std::vector<std::byte> take_part_buffer() {
    std::lock_guard lock(spare_mutex_);
    if (spare_parts_.empty()) return {};
    auto b = std::move(spare_parts_.back());
    spare_parts_.pop_back();
    return b;
  }
  void keep_part_buffer(std::vector<std::byte> b) noexcept {
    if (b.capacity() == 0) return;
    b.clear();
    std::lock_guard lock(spare_mutex_);
    if (spare_parts_.size() > options_.parallel) return;
    try {
      spare_parts_.push_back(std::move(b));
    } catch (...) {  // no room for the list: the buffer is freed, as without keeping
    }
  }

  // Runs `work` on one of the worker threads, made on first use (a sink that only reads small objects never starts
  // them), at no higher priority than the calling thread's (core/thread_options.hpp): a checkpointer's lowered
  // threads upload through lowered workers, also when a load at the trainer's priority made the workers earlier.
  // A worker once lowered stays so (raising needs a privilege): only the sink's later transfers share it.
  void post_work(std::function<void()> work) {
    workers().post([nice = shardkit::detail::this_thread_nice(), work = std::move(work)] {
      shardkit::detail::lower_this_thread_to(nice);
      work();
    });
  }

  // Runs r until it succeeds, fails for good, or runs out of attempts; returns the last response (the caller
  // decides what a 404 or 416 means). A GET that broke off after some bytes resumes where it stopped.
  response execute(request r) {
    response out;
    std::size_t got = 0;
    for (unsigned attempt = 1;; ++attempt) {
      response one;
      {
        pooled_handle h = take();
        perform(h, r, one);
        give(std::move(h));
      }
      one.attempts = attempt;
      if (r.error_in_ok && one.ok() && one.text.find("<Error>") != std::string::npos) one.error_body = true;
      if (!r.into.empty() && (one.status == 206 || one.status == 200)) {
        got += one.received;
        if (one.curl != CURLE_OK && one.received > 0) {  // resume after the bytes that arrived
          r.into = r.into.subspan(one.received);
          *r.range_begin += one.received;
        }
      }
      one.received = got;
      out = std::move(one);
      const unsigned most = out.curl == CURLE_COULDNT_CONNECT ? std::min(options_.max_attempts, connect_error_attempts)
                                                             : options_.max_attempts;
      if (out.ok() || !retriable(out) || attempt >= most) return out;
      const auto wait = backoff(attempt);
      log::info("s3 ", r.operation, " ", url_of(r.subject()), ": ", describe(out), "; retry ", attempt, " of ",
                most - 1, " in ", wait.count(), " ms");
      std::this_thread::sleep_for(wait);
    }
  }

  // "HTTP 503 SlowDown (Please reduce your request rate.)", "connection to http://host:9000: Connection reset by
  // peer (curl 56)", or "connection refused by the endpoint http://host:9000 (does an S3 server listen there?): ...".
  std::string describe(const response& r) const {
    std::string s;
    if (r.curl != CURLE_OK) {
      const std::string what = r.curl_error.empty() ? std::string(curl_easy_strerror(r.curl)) : r.curl_error;
      const std::string curl = " (curl " + std::to_string(static_cast<int>(r.curl)) + ")";
      if (r.curl == CURLE_COULDNT_CONNECT && r.os_errno == ECONNREFUSED)
        s = "connection refused by the endpoint " + options_.endpoint + " (does an S3 server listen there?): " + what + curl;
      else
        s = "connection to " + options_.endpoint + ": " + what + curl;
    } else {
      s = "HTTP " + std::to_string(r.status);
      const std::string code = r.code(), message = xml_value(r.text, "Message");
      if (!code.empty()) s += " " + code;
      if (!message.empty()) s += " (" + message + ")";
      if (r.error_body) s += " (an error in a " + std::to_string(r.status) + " reply)";
      if (code.empty() && r.text.empty() && (r.status == 403 || r.status == 404))
        s += r.status == 403 ? " (no error code in the reply: check the credentials and the bucket's policy)"
                             : " (no error code in the reply)";
    }
    return scrub(s);
  }

  // The error for a failed request: names the S3 operation, the bucket and key, the HTTP status and S3 code, and
  // how many attempts were made. context().operation is the sink operation, context().object the sink key.
  [[noreturn]] void fail(const response& r, const request& q, const char* sink_operation, const std::string& key,
                         errc e = errc::io) const {
    std::string detail = "S3 " + std::string(q.operation) + " " + url_of(q.subject()) + ": " + describe(r);
    detail += r.attempts <= 1 ? (retriable(r) ? " (1 attempt)" : " (not retried)")
                              : " (after " + std::to_string(r.attempts) + " attempts)";
    if (r.curl == CURLE_OK && r.code() == "NoSuchBucket") detail += no_such_bucket_hint(q);
    throw_error(e, scrub(detail), {.operation = sink_operation, .object = key});
  }

  // What a NoSuchBucket answer likely means, and the URL that was asked: a bucket exists as spelled (S3 names are
  // case-sensitive), or the endpoint's path put the bucket elsewhere in the URL than the server looks for it.
  std::string no_such_bucket_hint(const request& q) const {
    std::string hint = "; the URL asked was " + url_asked(q);
    const auto scheme_end = options_.endpoint.find("://") + 3;
    const auto path_start = options_.endpoint.find('/', scheme_end);
    if (path_start != std::string::npos && !virtual_hosted_) {
      const std::string path = options_.endpoint.substr(path_start);
      const auto first = path.find('/', 1);
      hint += ". The endpoint " + options_.endpoint + " has the path '" + path + "': a server that serves buckets at its "
              "root takes '" + path.substr(1, first == std::string::npos ? std::string::npos : first - 1) +
              "' for the bucket. An S3 endpoint is usually " + options_.endpoint.substr(0, path_start) +
              " alone (AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or s3_options::endpoint), the bucket in the location "
              "s3://" + location_.bucket + "/prefix";
    }
    const bool legacy_only = std::any_of(location_.bucket.begin(), location_.bucket.end(), [](char c) {
      return std::isupper(static_cast<unsigned char>(c)) || c == '_';
    });
    if (legacy_only) {
      std::string today;
      for (char c : location_.bucket) today += c == '_' ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      hint += ". The bucket name '" + location_.bucket + "' is not valid for a bucket created today (lower case letters, "
              "digits, '.' and '-'): upper case and '_' are only valid for legacy us-east-1 buckets (created before "
              "March 2018), and names are case-sensitive: is it '" + today + "'?";
    }
    return hint;
  }

  // Removes any credential text from a message (a server could echo one back; nothing of ours prints them).
  std::string scrub(std::string s) const {
    const auto& c = *options_.credentials;
    for (const std::string* secret : {&c.secret_access_key, &c.session_token, &c.access_key_id}) {
      if (secret->size() < 4) continue;
      for (auto at = s.find(*secret); at != std::string::npos; at = s.find(*secret, at)) s.replace(at, secret->size(), "***");
    }
    return s;
  }

 private:
  thread_pool& workers() {
    std::lock_guard lock(pool_mutex_);
    if (!pool_) pool_ = std::make_unique<thread_pool>(options_.parallel, thread_options{.name = "sk-s3"});
    return *pool_;
  }

  std::chrono::milliseconds backoff(unsigned attempt) const {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const auto base = options_.base_backoff.count();
    const auto cap = std::min<std::int64_t>(options_.max_backoff.count(), base << std::min(attempt - 1, 20u));
    return std::chrono::milliseconds(std::uniform_int_distribution<std::int64_t>(0, std::max<std::int64_t>(cap, 0))(rng));
  }

  // An easy handle (its connection kept alive in it) and the sockets libcurl made for it.
  struct pooled_handle {
    easy_ptr easy;
    made_sockets sockets;
  };

  pooled_handle take() {
    {
      std::lock_guard lock(handles_mutex_);
      if (!idle_.empty()) {
        pooled_handle h = std::move(idle_.back());
        idle_.pop_back();
        return h;
      }
    }
    pooled_handle h{easy_ptr(curl_easy_init()), {}};
    if (!h.easy) throw_error(errc::out_of_memory, "curl_easy_init failed", {.operation = "s3_sink"});
    return h;
  }
  void give(pooled_handle h) {
    std::lock_guard lock(handles_mutex_);
    if (idle_.size() < 2 * std::size_t(options_.parallel) + 4) idle_.push_back(std::move(h));
  }

  struct transfer {
    const request* r;
    response* out;
    CURL* h;
    const made_sockets* sockets;  // the handle's, where a governed download finds its socket
    std::size_t sent = 0;
    std::uint64_t skip = 0;  // a server that ignored Range sends the object from its start
    bool status_known = false;
    bool into_data = false;
    const s3_options* options = nullptr;  // its governor paces the body bytes
  };

  //! Waits until the governor grants up to `want` bytes of class `c` in direction `d` (tx: a request body sent,
  //! rx: an object body received). A wait that outlasts a quarter of the stall timeout moves a small step anyway
  //! (reported), so pacing never makes libcurl abandon the transfer as stalled.
  static std::size_t paced(const s3_options& o, link_direction d, traffic_class c, std::size_t want) {
    if (want == 0) return 0;
    const auto deadline = link_governor::clock::now() + o.stall_timeout / 4;
    if (const auto g = o.governor->acquire(d, c, want, {}, deadline)) return static_cast<std::size_t>(g);
    const std::size_t step = std::min<std::size_t>(want, 16 << 10);
    o.governor->report(d, c, step);
    return step;
  }

  static size_t on_read(char* buffer, size_t size, size_t n, void* user) {
    auto* t = static_cast<transfer*>(user);
    std::size_t count = std::min(size * n, t->r->body.size() - t->sent);
    if (t->options->governor) count = paced(*t->options, link_direction::tx, t->options->upload_class, count);
    if (count) std::memcpy(buffer, t->r->body.data() + t->sent, count);
    t->sent += count;
    return count;
  }

  // libcurl rewinds the body when it resends a request (a reused connection the server had closed).
  static int on_seek(void* user, curl_off_t offset, int origin) {
    auto* t = static_cast<transfer*>(user);
    if (origin != SEEK_SET || offset < 0 || static_cast<std::uint64_t>(offset) > t->r->body.size())
      return CURL_SEEKFUNC_CANTSEEK;
    t->sent = static_cast<std::size_t>(offset);
    return CURL_SEEKFUNC_OK;
  }

  static size_t on_write(char* data, size_t size, size_t n, void* user) {
    auto* t = static_cast<transfer*>(user);
    std::size_t count = size * n;
    if (!t->status_known) {
      long status = 0;
      curl_easy_getinfo(t->h, CURLINFO_RESPONSE_CODE, &status);
      t->status_known = true;
      t->into_data = !t->r->into.empty() && (status == 200 || status == 206);
      if (status == 200 && t->r->range_begin) t->skip = *t->r->range_begin;
    }
    if (!t->into_data) {
      // A ListObjectsV2 page of 1000 long keys is a few hundred KiB; a body far beyond that is not S3 talking.
      if (t->out->text.size() + count > (std::size_t(64) << 20)) return 0;
      t->out->text.append(data, count);
      return count;
    }
    std::size_t at = 0;
    if (t->skip) {
      at = static_cast<std::size_t>(std::min<std::uint64_t>(t->skip, count));
      t->skip -= at;
    }
    const std::size_t room = t->r->into.size() - t->out->received;
    const std::size_t take = std::min(room, count - at);
    if (take) std::memcpy(t->r->into.data() + t->out->received, data + at, take);
    t->out->received += take;
    // Holding this callback holds this connection's receive window: the server's sending slows to the grants, at
    // most its receive buffer ahead of them (about rate x RTT: bound_receive_window).
    if (t->options->governor)
      for (std::size_t paid = 0; paid < count;)
        paid += paced(*t->options, link_direction::rx, t->options->download_class, count - paid);
    return count;  // bytes past the range (a server ignoring Range) are dropped
  }

#if LIBCURL_VERSION_NUM >= 0x075000
  // A governed download's connection is made or reused; its request is not sent yet.
  static int on_connected(void* user, char*, char*, int remote_port, int local_port) {
    auto* t = static_cast<transfer*>(user);
    bound_receive_window(*t->sockets, local_port, remote_port, *t->options->governor);
    return CURL_PREREQFUNC_OK;
  }
#endif

  static size_t on_header(char* data, size_t size, size_t n, void* user) {
    auto* t = static_cast<transfer*>(user);
    const std::string_view line(data, size * n);
    const auto named = [&](std::string_view name) {
      if (line.size() <= name.size() || line[name.size()] != ':') return false;
      for (std::size_t i = 0; i < name.size(); ++i)
        if (std::tolower(static_cast<unsigned char>(line[i])) != name[i]) return false;
      return true;
    };
    if (named("etag")) t->out->etag = trim(line.substr(5));
    // A range of an empty object: S3 answers 416, but some servers (s3rver) send "206, Content-Range: bytes
    // 0-0/0, Content-Length: 1" and then no byte, which would hang until the connection times out.
    if (named("content-range") && trim(line.substr(14)).ends_with("/0")) {
      t->out->empty_object = true;
      return 0;  // abandons the transfer (perform reports it as 416)
    }
    return size * n;
  }

  // The URL a request is sent to.
  std::string url_asked(const request& r) const {
    std::string url = base_url_;
    if (!r.key.empty()) url += "/" + uri_encode(r.key, true);
    else if (virtual_hosted_) url += "/";
    if (!r.query.empty()) url += "?" + r.query;
    return url;
  }

  void perform(pooled_handle& handle, const request& r, response& out) const {
    CURL* h = handle.easy.get();
    curl_easy_reset(h);  // keeps the connection cache: the point of reusing handles
    const std::string url = url_asked(r);
    transfer t{.r = &r, .out = &out, .h = h, .sockets = &handle.sockets, .options = &options_};
    char error_buffer[CURL_ERROR_SIZE] = {};
    curl_slist* headers = nullptr;
    const auto add = [&](const std::string& hdr) { headers = curl_slist_append(headers, hdr.c_str()); };
    // The payload is not hashed (UNSIGNED-PAYLOAD): hashing 8 MiB parts costs CPU that TLS's own integrity makes
    // redundant, and is what the AWS SDKs do over https.
    add("x-amz-content-sha256: UNSIGNED-PAYLOAD");
    // No "Expect:" entry to keep libcurl from sending "Expect: 100-continue": libcurl before 8.3.0 (Debian 12's
    // 7.88.1) lists such a header-removal entry in SignedHeaders while sending no such header, and S3 and MinIO
    // refuse that signature. libcurl adds its Expect header to uploads after signing (unsigned, as the AWS SDKs
    // send it, on every version); a wait of 0 for the "100 Continue" sends the body at once, without the round trip.
    if (!options_.credentials->session_token.empty()) add("x-amz-security-token: " + options_.credentials->session_token);
    if (r.range_begin && !r.into.empty())
      add("Range: bytes=" + std::to_string(*r.range_begin) + "-" + std::to_string(*r.range_begin + r.into.size() - 1));
    for (const auto& hdr : r.headers) add(hdr);

    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_AWS_SIGV4, sigv4_.c_str());
    curl_easy_setopt(h, CURLOPT_USERNAME, options_.credentials->access_key_id.c_str());
    curl_easy_setopt(h, CURLOPT_PASSWORD, options_.credentials->secret_access_key.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_HTTP_VERSION, CURL_HTTP_VERSION_1_1);
    curl_easy_setopt(h, CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    // Governed: libcurl asks for (and is granted) 128 KiB at a time instead of 1 MiB, and each connection keeps at
    // most 128 KiB unsent in its socket (TCP_NOTSENT_LOWAT), so granted bytes do not pile up in buffers ahead of
    // the collectives' packets; the grants themselves are paced to the link (core/link_demand.hpp). A download's
    // receive buffer is sized before its request goes (bound_receive_window). These options are in Debian 12's
    // libcurl 7.88 (UPLOAD_BUFFERSIZE since 7.62, SOCKOPTFUNCTION since 7.16, PREREQFUNCTION since 7.80).
    const long io_bytes = options_.governor ? paced_io_bytes : 1L << 20;
    curl_easy_setopt(h, CURLOPT_BUFFERSIZE, io_bytes);
    curl_easy_setopt(h, CURLOPT_UPLOAD_BUFFERSIZE, io_bytes);
    if (options_.governor) {
      curl_easy_setopt(h, CURLOPT_SOCKOPTFUNCTION, &governed_socket_made);
      curl_easy_setopt(h, CURLOPT_SOCKOPTDATA, &handle.sockets);
    }
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.connect_timeout.count()));
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::max<std::int64_t>(1, (options_.stall_timeout.count() + 999) / 1000)));
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &client::on_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &client::on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, options_.verify_tls ? 1L : 0L);
    curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, options_.verify_tls ? 2L : 0L);
    if (!options_.ca_bundle.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, options_.ca_bundle.c_str());
    const std::string_view method = r.method;
    if (method == "HEAD") {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (method == "PUT") {
      curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(h, CURLOPT_READFUNCTION, &client::on_read);
      curl_easy_setopt(h, CURLOPT_READDATA, &t);
      curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
      curl_easy_setopt(h, CURLOPT_SEEKFUNCTION, &client::on_seek);
      curl_easy_setopt(h, CURLOPT_SEEKDATA, &t);
    } else if (method == "POST") {
      curl_easy_setopt(h, CURLOPT_POST, 1L);
      curl_easy_setopt(h, CURLOPT_READFUNCTION, &client::on_read);
      curl_easy_setopt(h, CURLOPT_READDATA, &t);
      curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
      curl_easy_setopt(h, CURLOPT_SEEKFUNCTION, &client::on_seek);
      curl_easy_setopt(h, CURLOPT_SEEKDATA, &t);
    } else if (method != "GET") {
      curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, r.method);
    }
#if LIBCURL_VERSION_NUM >= 0x075000
    if (options_.governor && method == "GET" && !r.into.empty()) {
      curl_easy_setopt(h, CURLOPT_PREREQFUNCTION, &client::on_connected);
      curl_easy_setopt(h, CURLOPT_PREREQDATA, &t);
    }
#endif
    out.curl = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &out.status);
    if (out.empty_object) out.curl = CURLE_OK, out.status = 416, out.received = 0;
    curl_off_t length = -1;
    if (curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length) == CURLE_OK && length >= 0)
      out.content_length = static_cast<std::uint64_t>(length);
    if (out.curl != CURLE_OK) {
      out.curl_error = error_buffer;
      curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &out.os_errno);
    }
    curl_slist_free_all(headers);
    // The handle must not keep pointers into this frame: the next request resets it anyway, but a pooled handle
    // is also cleaned up by the pool, which must not see dangling user data.
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
    curl_easy_setopt(h, CURLOPT_SOCKOPTFUNCTION, static_cast<curl_sockopt_callback>(nullptr));
#if LIBCURL_VERSION_NUM >= 0x075000
    curl_easy_setopt(h, CURLOPT_PREREQFUNCTION, static_cast<curl_prereq_callback>(nullptr));
#endif
  }

  s3_location location_;
  s3_options options_;
  std::string base_url_;
  bool virtual_hosted_;
  std::string sigv4_;
  std::mutex handles_mutex_;
  std::vector<pooled_handle> idle_;
  std::mutex pool_mutex_;
  std::mutex spare_mutex_;
  std::vector<std::vector<std::byte>> spare_parts_;  // take_part_buffer / keep_part_buffer
  std::unique_ptr<thread_pool> pool_;
};

}  // namespace shardkit::storage::detail::s3
