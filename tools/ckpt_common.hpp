#pragma once
// What shardkit-ckpt's commands share: opening a location, choosing the checkpoint (--step or the latest), and
// formatting sizes and shapes.
#include <cctype>
#include <charconv>
#include <chrono>
#include <exception>
#include <filesystem>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "shardkit/ckpt/catalog.hpp"
#include "shardkit/ckpt/index.hpp"
#include "shardkit/ckpt/lease.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "shardkit/storage/sink.hpp"
#if __has_include("shardkit/storage/open_sink.hpp")
#include "shardkit/storage/open_sink.hpp"
#define SHARDKIT_CKPT_CLI_OPEN_SINK 1
#endif

namespace ckpt_cli {

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;

//! What every command takes besides its own options.
struct common_options {
  std::string location;
  std::optional<std::uint64_t> step;  //!< --step N; none: the latest complete checkpoint
  bool progress = false;              //!< --progress: bars even when stderr is not a terminal
  bool json = false;                  //!< --json (ls, inspect): a JSON document instead of a table
};

//! What an error says, without the "shardkit op 'object': category:" prefix where the detail already names them.
inline std::string message_of(const std::exception& e) {
  if (const auto* s = dynamic_cast<const sk::error*>(&e)) {
    const std::string& object = s->context().object;
    if (s->detail().empty()) return s->what();
    if (object.empty() || s->detail().find(object) != std::string::npos) return s->detail();
    return object + ": " + s->detail();
  }
  return e.what();
}

//! "1 problem", "2 problems".
inline std::string plural(std::size_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

//! "1.50 GiB": binary units, three significant digits; exact below 1 KiB.
inline std::string human_bytes(std::uint64_t n) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (n < 1024) return std::to_string(n) + " B";
  double v = double(n);
  int u = 0;
  while (v >= 1024 && u < 5) v /= 1024, ++u;
  char out[32];
  std::snprintf(out, sizeof out, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v, units[u]);
  return out;
}

inline std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

inline std::string range_text(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

//! A size with an optional unit, as Hugging Face's max_shard_size takes it: "5GB" (10^9), "500MiB" (2^20), "123".
inline std::optional<std::uint64_t> parse_size(std::string_view text) {
  std::uint64_t number = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc{} || end == text.data()) return std::nullopt;
  std::string unit(end, text.data() + text.size());
  for (auto& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  struct suffix {
    const char* name;
    std::uint64_t factor;
  };
  static constexpr suffix suffixes[] = {{"", 1},           {"B", 1},           {"KB", 1000},        {"MB", 1000'000},
                                        {"GB", 1000'000'000}, {"TB", 1000'000'000'000}, {"KIB", 1ull << 10},
                                        {"MIB", 1ull << 20}, {"GIB", 1ull << 30}, {"TIB", 1ull << 40}};
  for (const auto& s : suffixes)
    if (unit == s.name) {
      if (number > UINT64_MAX / s.factor) return std::nullopt;
      return number * s.factor;
    }
  return std::nullopt;
}

//! The location as a sink. Reading commands pass create = false, so that a mistyped directory is an error rather
//! than a new empty one.
inline st::any_sink open_location(const std::string& location, bool create) {
#if defined(SHARDKIT_CKPT_CLI_OPEN_SINK)
  st::open_sink_options options;
  options.posix.create_root = create;
  return st::open_sink(location, options);
#else
  if (location.find("://") != std::string::npos)
    sk::throw_error(sk::errc::unsupported, "this shardkit-ckpt reads directories only (no storage/open_sink.hpp)",
                    {.operation = "shardkit-ckpt", .object = location});
  st::posix_sink_options options;
  options.create_root = create;
  return st::make_sink<st::posix_sink>(location, options);
#endif
}

//! The location's lease (ckpt/lease.hpp) as ls and gc judge it, with the verdict a resume's takeover gives: whether
//! a live run writes there.
struct lease_state {
  std::optional<ck::lease_record> record;  //!< none: no lease object, no run holds the location
  std::string stale_reason;                //!< empty while its holder is live
  std::int64_t now = 0;                    //!< seconds since the epoch when it was read
  std::chrono::seconds expiry{0};          //!< what judged it: the holder's recorded expiry, else the default

  bool live() const { return record && stale_reason.empty(); }
  //! "run R holds the lease (host H, pid P, renewed N s ago)" while live; else "run R's lease (host H, pid P, renewed
  //! N s ago) is stale: why", or what the object is when it is not a lease.
  std::string holder_text() const {
    const auto& l = *record;
    if (!l.unparsed.empty()) return std::string(ck::lease_object_name) + " is " + l.describe(now) + ": no run holds it";
    const std::string details = " (host " + l.host + ", pid " + std::to_string(l.pid) + ", " + l.renewal_text(now) + ")";
    if (live()) return "run " + l.run + " holds the lease" + details;
    return "run " + l.run + "'s lease" + details + " is stale: " + stale_reason;
  }
};

//! For a directory location (a path or file://): what stands at its lease.json when that is not a file (a directory
//! of that name, which the sink cannot read as an object), else empty.
inline std::string lease_path_problem(const std::string& location) {
  if (location.find("://") != std::string::npos && !location.starts_with("file://")) return {};
  const std::filesystem::path dir = location.starts_with("file://") ? location.substr(7) : location;
  std::error_code ec;
  const auto status = std::filesystem::status(dir / ck::lease_object_name, ec);
  if (ec || !std::filesystem::exists(status) || std::filesystem::is_regular_file(status)) return {};
  return std::filesystem::is_directory(status) ? "a directory" : "not a regular file";
}

inline lease_state read_location_lease(st::any_sink& sink, const std::string& location) {
  lease_state s;
  s.record = ck::read_lease(sink, ck::lease_key(""));
  if (!s.record)
    if (const auto what = lease_path_problem(location); !what.empty())
      s.record = ck::lease_record{.unparsed = "damaged: it is " + what + ", not an object; a checkpointer's first save "
                                                                         "here fails until it is removed"};
  if (!s.record) return s;
  s.now = ck::detail::unix_seconds();
  // A holder that did not record its expiry is judged by the default one.
  const auto reader = s.record->expiry > 0 ? std::chrono::seconds(0) : ck::default_lease_expiry;
  s.expiry = ck::lease_expiry_of(*s.record, reader);
  s.stale_reason = ck::lease_stale_reason(*s.record, s.now, reader, ck::detail::host_name());
  return s;
}

//! The tool's location is the directory that holds step-*/ (what the checkpointer's sink root plus its prefix
//! name); a checkpointer saving under a prefix ("runs/7/") wrote file keys with that prefix. Keys are made relative
//! to the location: the part from "step-<12 digits>/" of the index's own step on.
inline ck::checkpoint_index relative_to_location(ck::checkpoint_index index) {
  const std::string step_dir = ck::step_prefix("", index.step);
  for (auto& f : index.files) {
    if (f.key.starts_with(step_dir)) continue;
    if (const auto at = f.key.find("/" + step_dir); at != std::string::npos) f.key.erase(0, at + 1);
  }
  return index;
}

//! The checkpoint a command works on: --step N (whose index must exist and parse) or the newest complete one.
inline ck::checkpoint_index choose_checkpoint(st::any_sink& sink, const common_options& o) {
  if (o.step) {
    auto index = ck::read_index(sink, "", *o.step);
    if (!index) {
      const bool has_objects = !sink.list(ck::step_prefix("", *o.step)).empty();
      sk::throw_error(sk::errc::not_found,
                      o.location + ": step " + std::to_string(*o.step) + " has no index " + ck::index_key("", *o.step) +
                          (has_objects ? ", so it is not a checkpoint (debris of a save that did not commit)"
                                       : " (no object of that step exists)"),
                      {.operation = "shardkit-ckpt", .object = o.location});
    }
    return relative_to_location(std::move(*index));
  }
  auto latest = ck::latest_checkpoint(sink, "");
  if (!latest)
    sk::throw_error(sk::errc::not_found,
                    o.location + " holds no complete checkpoint (no step-*/index.json that parses)" +
                        (sink.exists(std::string(ck::index_object_name))
                             ? "; it looks like one checkpoint's step-* directory: give its parent and --step N"
                             : ""),
                    {.operation = "shardkit-ckpt", .object = o.location});
  return relative_to_location(std::move(*latest));
}

//! The rank a file belongs to: the number in its name "rank-<digits>.safetensors", else its position in the index
//! (the checkpointer lists files in rank order).
//! What one step takes on storage: its files as its index lists them, and the index itself. ls, inspect and verify
//! all say this one size for a step.
inline std::uint64_t step_bytes(st::any_sink& sink, const ck::checkpoint_index& index) {
  std::uint64_t bytes = sink.size(ck::index_key("", index.step)).value_or(0);
  for (const auto& f : index.files) bytes += f.size;
  return bytes;
}

inline std::uint32_t rank_of_file(const ck::checkpoint_index& index, std::size_t position) {
  const std::string& key = index.files[position].key;
  const auto at = key.rfind("/rank-");
  if (at != std::string::npos) {
    std::uint32_t r = 0;
    const char* first = key.data() + at + 6;
    auto [end, ec] = std::from_chars(first, key.data() + key.size(), r);
    if (ec == std::errc{} && std::string_view(end) == ".safetensors") return r;
  }
  return std::uint32_t(position);
}

//! The global tensors of an index in the table's order (the order they first appear: rank 0's file first, the
//! model's order).
inline std::vector<std::string> tensor_names(const ck::checkpoint_index& index) {
  std::vector<std::string> names;
  names.reserve(index.tensors.size());
  for (const auto& t : index.tensors) names.push_back(t.name);
  return names;
}

}  // namespace ckpt_cli
