#pragma once
//! The multipart uploads of an S3 sink that no writer completed or aborted (what a writer killed mid-upload
//! leaves: invisible, but billed): listed with ListMultipartUploads, their parts read with ListParts as a sink
//! temporary (storage/sink.hpp, sink_keeps_temporaries), aborted with AbortMultipartUpload. s3_sink's
//! pending_uploads(), temporaries() and remove_stale_temporaries() are these; a writer's abort is the last.
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>

#include "shardkit/storage/s3/detail/client.hpp"
#include "shardkit/storage/s3/detail/text.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::storage::detail::s3 {

//! Calls found(key, upload_id, initiated) for every pending upload under the sink key `prefix`, all pages; `key` is
//! the sink key (the sink's prefix removed), `initiated` the server's clock (epoch when it gave none).
template <class F>
void for_each_pending_upload(client& c, const std::string& prefix, F&& found) {
  std::string key_marker, id_marker;
  while (true) {
    std::string query;
    if (!key_marker.empty()) query += "key-marker=" + uri_encode(key_marker, false) + "&";
    const std::string full = c.location().prefix + prefix;
    if (!full.empty()) query += "prefix=" + uri_encode(full, false) + "&";
    if (!id_marker.empty()) query += "upload-id-marker=" + uri_encode(id_marker, false) + "&";
    query += "uploads=";
    request r{.operation = "ListMultipartUploads", .about = full, .query = query};
    auto resp = c.execute(r);
    if (!resp.ok()) c.fail(resp, r, "sink.pending_uploads", prefix);
    for (const auto& block : xml_blocks(resp.text, "Upload")) {
      const std::string k = xml_value(block, "Key");
      if (k.starts_with(c.location().prefix))
        found(k.substr(c.location().prefix.size()), xml_value(block, "UploadId"),
              parse_iso8601(xml_value(block, "Initiated")).value_or(std::chrono::system_clock::time_point{}));
    }
    if (xml_value(resp.text, "IsTruncated") != "true") break;
    key_marker = xml_value(resp.text, "NextKeyMarker");
    id_marker = xml_value(resp.text, "NextUploadIdMarker");
    if (key_marker.empty() && id_marker.empty()) break;
  }
}

//! The pending upload of sink key `key` as a temporary: the bytes of its parts and its last modification, the
//! newest of `initiated` and its parts' (ListParts, all pages: a live writer keeps adding parts). nullopt when the
//! upload is gone (completed or aborted meanwhile: NoSuchUpload).
inline std::optional<temporary_object> pending_upload_parts(client& c, const std::string& key, const std::string& upload_id,
                                                            std::chrono::system_clock::time_point initiated) {
  temporary_object t{key, 0, initiated};
  std::string marker;
  while (true) {
    std::string query;
    if (!marker.empty()) query += "part-number-marker=" + marker + "&";
    query += "uploadId=" + uri_encode(upload_id, false);
    request r{.operation = "ListParts", .key = c.full_key(key), .query = query};
    auto resp = c.execute(r);
    if (resp.curl == CURLE_OK && resp.status == 404 && resp.code() == "NoSuchUpload") return std::nullopt;
    if (!resp.ok()) c.fail(resp, r, "sink.temporaries", key);
    for (const auto& part : xml_blocks(resp.text, "Part")) {
      t.bytes += std::strtoull(xml_value(part, "Size").c_str(), nullptr, 10);
      if (auto when = parse_iso8601(xml_value(part, "LastModified")); when && *when > t.modified) t.modified = *when;
    }
    if (xml_value(resp.text, "IsTruncated") != "true") break;
    marker = xml_value(resp.text, "NextPartNumberMarker");
    if (marker.empty()) break;
  }
  return t;
}

//! AbortMultipartUpload of the object `full_key` (the sink's prefix included); an upload already gone is not an
//! error.
inline void abort_multipart(client& c, const std::string& full_key, const std::string& upload_id) {
  request r{.operation = "AbortMultipartUpload", .method = "DELETE", .key = full_key,
            .query = "uploadId=" + uri_encode(upload_id, false)};
  auto resp = c.execute(r);
  if (!resp.ok() && resp.code() != "NoSuchUpload") c.fail(resp, r, "sink.abort", full_key);
}

}  // namespace shardkit::storage::detail::s3
