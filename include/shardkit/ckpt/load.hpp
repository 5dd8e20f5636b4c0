#pragma once
//! Loading a checkpoint into a state_dict, at any world size: each rank reads only the byte ranges its pieces need
//! and verifies every byte it uses against the index's checksums.
//!
//! The plan: for each tensor the rank loads (elements [begin, end) of a global tensor), the saved pieces of that
//! tensor that overlap the range, from whichever ranks' files hold them (N saved ranks, M loading ranks: resharding).
//! The bytes a piece contributes are read with ranged gets rounded out to the index's checksum chunks
//! (checksum_chunk_bytes), and each chunk is verified before any of its bytes is used; a piece of one chunk is read
//! whole and verified against its xxh64. A checksum mismatch is errc::io naming the file, the tensor and the bytes.
//!
//! Errors name the checkpoint and what is wrong: a tensor the rank needs that the checkpoint lacks, another dtype or
//! global shape, elements no saved piece covers (errc::invalid_argument); a file that ended early (errc::io).
#include <algorithm>
#include <mutex>
#include <exception>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardkit/ckpt/catalog.hpp"
#include "shardkit/ckpt/device.hpp"
#include "shardkit/ckpt/format.hpp"
#include "shardkit/ckpt/index.hpp"
#include "shardkit/ckpt/load_report.hpp"
#include "shardkit/ckpt/state.hpp"
#include "shardkit/codec/xxh64.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::ckpt {

//! Every saved piece of every tensor of an index, by tensor, sorted by where each begins. Built once per load in
//! O(pieces log pieces); a rank then finds its overlaps by binary search.
class load_plan {
 public:
  struct source {
    const index_file* file;
    const index_piece* piece;
    const index_tensor* tensor;
    std::uint64_t data_start;  //!< where the file's data begins (its size less its data: the format ends with data)
  };

  explicit load_plan(const checkpoint_index& index) : pieces_(index.tensors.size()) {
    position_.reserve(index.tensors.size());
    for (std::uint32_t i = 0; i < index.tensors.size(); ++i) position_.emplace(index.tensors[i].name, i);
    std::vector<std::size_t> count(index.tensors.size(), 0);
    for (const auto& f : index.files)
      for (const auto& p : f.pieces) ++count.at(p.tensor);
    for (std::size_t i = 0; i < count.size(); ++i) pieces_[i].reserve(count[i]);
    for (const auto& f : index.files) {
      std::uint64_t data = 0;
      for (const auto& p : f.pieces) data = std::max(data, p.data_end);
      const std::uint64_t start = f.size - data;
      for (const auto& p : f.pieces) pieces_[p.tensor].push_back({&f, &p, &index.tensors[p.tensor], start});
    }
    // Ranks' files are in rank order and flat shards in rank order too: usually sorted already.
    auto by_begin = [](const source& a, const source& b) { return a.piece->begin < b.piece->begin; };
    for (auto& v : pieces_)
      if (!std::is_sorted(v.begin(), v.end(), by_begin)) std::sort(v.begin(), v.end(), by_begin);
  }

  //! The saved pieces of `name`, sorted by begin; empty when the checkpoint has none.
  std::span<const source> pieces(std::string_view name) const {
    auto it = position_.find(name);
    if (it == position_.end()) return {};
    return pieces_[it->second];
  }
  std::size_t tensor_count() const noexcept { return position_.size(); }

 private:
  std::vector<std::vector<source>> pieces_;                    // by position in the index's table
  std::unordered_map<std::string_view, std::uint32_t> position_;  // views of the index's names
};

namespace detail {

//! Reads bytes [first, last) of a saved piece into out (last - first bytes), verifying the checksum chunks (or the
//! whole piece) that cover them. Returns the bytes read from the sink.
template <storage::sink S>
std::uint64_t read_verified(S& sink, const load_plan::source& src, std::uint64_t first, std::uint64_t last,
                            std::span<std::byte> out, std::vector<std::byte>& scratch) {
  const index_piece& t = *src.piece;
  const std::string& name = src.tensor->name;
  const std::string& key = src.file->key;
  const std::uint64_t n = t.nbytes();
  auto get = [&](std::uint64_t from, std::span<std::byte> into) {
    std::size_t got = 0;
    try {
      got = sink.get(key, src.data_start + t.data_begin + from, into);
    } catch (const shardkit::error& e) {
      // The sink's "no such object" says neither that a checkpoint's index lists the file nor what it should hold.
      if (e.code() != make_error_code(errc::not_found)) throw;
      throw_error(errc::not_found, "the file " + key + ", which the checkpoint's index lists with tensor '" + name +
                                       "', is absent (deleted after the save committed?)",
                  {.operation = "ckpt.load", .object = key});
    }
    if (got != into.size())
      throw_error(errc::io, "the file " + key + " ended while reading tensor '" + name + "' (truncated?)",
                  {.operation = "ckpt.load", .object = key});
  };
  auto mismatch = [&](std::uint64_t from, std::uint64_t to, std::uint64_t got, std::uint64_t want) {
    throw_error(errc::io,
                "checksum mismatch in " + key + ", tensor '" + name + "' bytes [" + std::to_string(from) + ", " +
                    std::to_string(to) + ") (xxh64 " + codec::checksum_to_hex(got) + ", the index says " + codec::checksum_to_hex(want) + ")",
                {.operation = "ckpt.load", .object = key});
  };
  // Bytes the caller wants whole are read straight into `out` and verified there: a copy through scratch would
  // cost as much CPU as the hash (on a loaded host the load is CPU-bound). Only the ends of a range that starts or
  // stops inside a checksum chunk go through scratch.
  if (t.chunk_xxh64.empty()) {
    const bool direct = first == 0 && last == n;
    if (!direct) scratch.resize(static_cast<std::size_t>(n));
    const std::span<std::byte> buffer = direct ? out.first(static_cast<std::size_t>(n)) : std::span<std::byte>(scratch);
    get(0, buffer);
    if (auto got = codec::xxh64(buffer); got != t.xxh64) mismatch(0, n, got, t.xxh64);
    if (!direct) std::memcpy(out.data(), scratch.data() + first, static_cast<std::size_t>(last - first));
    return n;
  }
  // Chunk by chunk, in reads of up to 16 chunks: bounded scratch, large enough requests.
  constexpr std::uint64_t C = checksum_chunk_bytes, batch = 16;
  std::uint64_t read = 0;
  for (std::uint64_t c = first / C; c * C < last; c += batch) {
    const std::uint64_t from = c * C, to = std::min({(c + batch) * C, n, (last + C - 1) / C * C});
    const bool direct = from >= first && to <= last;
    if (!direct) scratch.resize(static_cast<std::size_t>(to - from));
    const std::span<std::byte> buffer = direct ? out.subspan(static_cast<std::size_t>(from - first), static_cast<std::size_t>(to - from))
                                               : std::span<std::byte>(scratch);
    get(from, buffer);
    read += to - from;
    for (std::uint64_t at = from; at < to; at += C) {
      const std::uint64_t end = std::min(at + C, n);
      const auto got = codec::xxh64(std::span<const std::byte>(buffer).subspan(static_cast<std::size_t>(at - from),
                                                                        static_cast<std::size_t>(end - at)));
      if (got != t.chunk_xxh64[static_cast<std::size_t>(at / C)]) mismatch(at, end, got, t.chunk_xxh64[static_cast<std::size_t>(at / C)]);
    }
    if (direct) continue;
    const std::uint64_t b = std::max(first, from), e = std::min(last, to);
    std::memcpy(out.data() + (b - first), scratch.data() + (b - from), static_cast<std::size_t>(e - b));
  }
  return read;
}

inline std::string describe_u64_shape(const std::vector<std::uint64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

//! The metadata the saver recorded in `index` (its own keys, not the checkpointer's "shardkit." ones), as
//! "model=examples/trainer, data=web": what says which model a checkpoint holds. Empty when it recorded none.
inline std::string recorded_metadata(const checkpoint_index& index) {
  std::string out;
  for (const auto& [key, value] : index.metadata)
    if (!key.starts_with("shardkit.")) out += (out.empty() ? "" : ", ") + key + "=" + value;
  return out;
}

//! For an error that a tensor is not in the checkpoint: what it holds instead, and what its saver recorded
//! (", which holds 26 tensors (embed.w, block0.w, ...) and records model=examples/trainer").
inline std::string what_checkpoint_holds(const checkpoint_index& index) {
  std::string names;
  std::size_t count = 0;
  for (const auto& t : index.tensors) {
    if (t.name.starts_with("rank/")) continue;  // per-rank entries: named by the state's rank entries
    if (count < 6) names += (count ? ", " : "") + t.name;
    ++count;
  }
  std::string out = ", which holds " + std::to_string(count) + (count == 1 ? " tensor" : " tensors") +
                    (count == 0 ? std::string{} : " (" + names + (count > 6 ? ", ...)" : ")"));
  const std::string recorded = recorded_metadata(index);
  return out + (recorded.empty() ? " and records no metadata of its saver's" : " and records " + recorded);
}

}  // namespace detail

//! Refuses a checkpoint whose index records another value for a key of `expected` (checkpointer_options::metadata:
//! what the loader's checkpoints are, {{"model", "my-lm"}}), with errc::invalid_argument naming the key and both
//! values, before anything is read. A key the index does not record passes: a checkpoint saved without it.
inline void check_expected_metadata(const checkpoint_index& index, const std::map<std::string, std::string>& expected,
                                    const std::string& checkpoint_name, int rank) {
  for (const auto& [key, want] : expected) {
    const auto it = index.metadata.find(key);
    if (it == index.metadata.end() || it->second == want) continue;
    throw_error(errc::invalid_argument,
                checkpoint_name + " (step " + std::to_string(index.step) + ") records " + key + "=" + it->second +
                    ", this load expects " + key + "=" + want + " (checkpointer_options::metadata): a checkpoint of "
                    "another " + key + "? Load it with its own program, or give this run its own location",
                {.rank = rank, .operation = "ckpt.load", .object = checkpoint_name});
  }
}

//! How a load reads.
struct load_options {
  //! Reads in flight at once on this rank (each a range of one saved piece, read, verified and copied by its own
  //! thread): one sequential stream leaves the disk idle while it hashes and copies.
  std::size_t threads = 4;
  //! Copies into the state's tensors that live on a device (ckpt/device.hpp); empty: host tensors only.
  any_checkpoint_device device;
};

namespace detail {
//! The name a state gives an index tensor: its own, or NAME for a per-rank entry stored as rank/R/NAME.
inline std::string_view state_name_of(std::string_view stored) {
  if (stored.starts_with("rank/"))
    if (const auto slash = stored.find('/', 5); slash != std::string_view::npos) stored.remove_prefix(slash + 1);
  return stored;
}

//! For each tensor of the index's table, 1 when `into` names it (a per-rank entry of any rank by its entry name).
inline std::vector<std::uint8_t> asked_for(const checkpoint_index& index, const state_dict& into) {
  std::set<std::string_view> asked;
  for (const auto* list : {&into.saved_tensors(), &into.loaded_only_tensors()})
    for (const auto& v : *list) asked.insert(v.name);
  for (const auto& e : into.rank_entries()) asked.insert(e.name);
  std::vector<std::uint8_t> out(index.tensors.size(), 0);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = asked.contains(state_name_of(index.tensors[i].name)) ? 1 : 0;
  return out;
}

//! The names (state_name_of, sorted, once each) of the index's tensors that `asked` marks 0.
inline std::vector<std::string> names_not_asked(const checkpoint_index& index, const std::vector<std::uint8_t>& asked) {
  std::set<std::string> left;
  for (std::size_t i = 0; i < asked.size(); ++i)
    if (!asked[i]) left.emplace(state_name_of(index.tensors[i].name));
  return {left.begin(), left.end()};
}

//! load_report::not_requested: the index's tensors and per-rank entries (stored as rank/R/NAME) that `into` names
//! nowhere.
inline std::vector<std::string> not_requested(const checkpoint_index& index, const state_dict& into) {
  return names_not_asked(index, asked_for(index, into));
}
}  // namespace detail

//! Loads every tensor of `into` (saved and loaded-only) from the checkpoint `index` describes, and this rank's
//! per-rank entries when the world size is unchanged. Every byte is verified against the index's checksums before
//! load_state returns; bytes a rank takes whole are read into `into` and verified there (tensors on a device: into
//! the device's host staging, uploaded once every byte is verified), so after an error (a checksum mismatch, a short
//! file) some tensors may hold loaded bytes, others their old ones, and the failed range unverified ones: load
//! again, from this or another checkpoint, before using the state.
template <storage::sink S>
load_report load_state(S& sink, const checkpoint_index& index, const state_dict& into, int rank, int world_size,
                       const std::string& checkpoint_name = "checkpoint", load_options options = {}) {
  load_report report{index.step, index.world_size, index.metadata};
  const load_plan plan(index);
  std::vector<std::byte> scratch;
  // The plan for this rank: every (saved piece, byte range, destination) its tensors need, checked first, so that a
  // checkpoint that cannot fill the state is refused before anything is read.
  struct read_job {
    const load_plan::source* source;
    std::uint64_t first, last;
    std::span<std::byte> out;
  };
  std::vector<read_job> jobs;
  // Tensors on a device are read and verified in host staging (the device's page-locked memory), then uploaded.
  struct upload_job {
    std::span<const std::byte> staged;
    std::byte* device_bytes;
  };
  std::vector<upload_job> uploads;
  staging_memory staging;
  {
    std::size_t staged = 0;
    for (const auto* list : {&into.saved_tensors(), &into.loaded_only_tensors()})
      for (const auto& v : *list) {
        if (v.location == device::host()) continue;
        options.device.check_serves(v.location, v.name, "ckpt.load");
        staged += (v.bytes.size() + 63) / 64 * 64;
      }
    if (staged > 0) staging = options.device.allocate_staging(staged);
  }
  std::size_t staging_used = 0;
  auto plan_one = [&](const tensor_view& v) {
    auto bad = [&](const std::string& what) {
      throw_error(errc::invalid_argument, checkpoint_name + " (step " + std::to_string(index.step) + "), tensor '" + v.name + "': " + what,
                  {.rank = rank, .operation = "ckpt.load", .object = v.name});
    };
    const auto pieces = plan.pieces(v.name);
    if (pieces.empty()) bad("not in the checkpoint" + detail::what_checkpoint_holds(index));
    const index_tensor& first = *pieces.front().tensor;  // every piece's: one table entry
    // A std::uint64_t value (state_dict::add_value) was stored as its 8 bytes, U8 [8], before u64 was a dtype:
    // such a checkpoint loads into the value as those bytes, in byte units.
    const bool value_saved_as_bytes = first.type == dtype::u8 && first.global_shape == std::vector<std::uint64_t>{8} &&
                                      v.type == dtype::u64 && v.global_shape == std::vector<std::uint64_t>{1} && v.begin == 0 && v.end == 1;
    if (first.type != v.type && !value_saved_as_bytes)
      bad("saved as " + std::string(safetensors_dtype(first.type)) + ", loaded as " + std::string(safetensors_dtype(v.type)) +
          ": a load converts no dtype (load into a buffer of the saved dtype, then shardkit::convert it)");
    if (first.global_shape != v.global_shape && !value_saved_as_bytes)
      bad("saved with global shape " + detail::describe_u64_shape(first.global_shape) + ", loaded as " +
          detail::describe_u64_shape(v.global_shape));
    const std::uint64_t es = size_of(first.type);
    const std::uint64_t v_begin = v.begin * size_of(v.type) / es, v_end = v.end * size_of(v.type) / es;
    std::span<std::byte> destination = v.bytes;
    if (v.location != device::host()) {
      destination = {staging.data() + staging_used, v.bytes.size()};
      staging_used += (v.bytes.size() + 63) / 64 * 64;
      uploads.push_back({destination, v.bytes.data()});
    }
    // Pieces sorted by begin; `at` is the first element not yet planned, so overlapping copies (replicas) load once.
    std::uint64_t at = v_begin;
    auto it = std::partition_point(pieces.begin(), pieces.end(), [&](const load_plan::source& s) { return s.piece->end <= v_begin; });
    for (; it != pieces.end() && at < v_end; ++it) {
      const index_piece& t = *it->piece;
      if (t.begin > at) break;  // a gap: reported below
      const std::uint64_t b = at, e = std::min(v_end, t.end);
      if (e <= b) continue;
      jobs.push_back({&*it, (b - t.begin) * es, (e - t.begin) * es,
                      destination.subspan(static_cast<std::size_t>((b - v_begin) * es), static_cast<std::size_t>((e - b) * es))});
      at = e;
    }
    if (at < v_end)
      bad("elements [" + std::to_string(at) + ", " + std::to_string(v_end) + ") are in no saved piece (this rank loads [" +
          std::to_string(v_begin) + ", " + std::to_string(v_end) + "))");
    ++report.tensors_loaded;
  };
  for (const auto& v : into.saved_tensors()) plan_one(v);
  for (const auto& v : into.loaded_only_tensors()) plan_one(v);

  // Largest first: the long reads start early and the small ones fill in around them.
  std::sort(jobs.begin(), jobs.end(), [](const read_job& a, const read_job& b) { return a.out.size() > b.out.size(); });
  std::atomic<std::size_t> next{0};
  std::atomic<std::uint64_t> bytes_read{0};
  std::mutex failure_mutex;
  std::exception_ptr failure;
  auto worker = [&] {
    std::vector<std::byte> own;
    for (std::size_t i; (i = next.fetch_add(1)) < jobs.size();) {
      {
        std::lock_guard lock(failure_mutex);
        if (failure) return;
      }
      try {
        const auto& j = jobs[i];
        bytes_read += detail::read_verified(sink, *j.source, j.first, j.last, j.out, own);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        return;
      }
    }
  };
  shardkit::detail::run_on_threads(std::min(std::max<std::size_t>(options.threads, 1), jobs.size()), worker);
  if (failure) std::rethrow_exception(failure);
  report.bytes_read += bytes_read;
  if (!uploads.empty()) {
    options.device.order_after_trainer();  // the trainer's queued kernels may still read what is replaced
    for (const auto& u : uploads) options.device.upload(u.staged, u.device_bytes);
    options.device.synchronize();
  }

  if (index.world_size == static_cast<std::uint32_t>(world_size)) {
    for (const auto& e : into.rank_entries()) {
      const std::string name = rank_entry_tensor(rank, e.name);
      const auto pieces = plan.pieces(name);
      if (pieces.empty())
        throw_error(errc::invalid_argument, checkpoint_name + " (step " + std::to_string(index.step) + ") has no per-rank entry '" +
                                                e.name + "' of rank " + std::to_string(rank),
                    {.rank = rank, .operation = "ckpt.load", .object = e.name});
      const index_piece& t = *pieces.front().piece;
      if (e.bytes) {
        e.bytes->resize(static_cast<std::size_t>(t.nbytes()));
        report.bytes_read += detail::read_verified(sink, pieces.front(), 0, t.nbytes(), *e.bytes, scratch);
      } else {
        if (t.nbytes() != e.value.size())
          throw_error(errc::invalid_argument,
                      "per-rank entry '" + e.name + "' of rank " + std::to_string(rank) + " holds " + std::to_string(t.nbytes()) +
                          " bytes, the state " + std::to_string(e.value.size()),
                      {.rank = rank, .operation = "ckpt.load", .object = e.name});
        report.bytes_read += detail::read_verified(sink, pieces.front(), 0, t.nbytes(), e.value, scratch);
      }
    }
    report.rank_entries_loaded = true;
  }
  report.not_requested = detail::not_requested(index, into);
  return report;
}

//! Every saved rank's bytes of the per-rank entry `name`, in saved-rank order (what a rescaled data loader
//! redistributes). errc::invalid_argument when a rank's entry is missing.
template <storage::sink S>
std::vector<std::vector<std::byte>> read_rank_bytes(S& sink, const checkpoint_index& index, const std::string& name) {
  const load_plan plan(index);
  std::vector<std::vector<std::byte>> out(index.world_size);
  std::vector<std::byte> scratch;
  for (std::uint32_t r = 0; r < index.world_size; ++r) {
    const auto pieces = plan.pieces(rank_entry_tensor(int(r), name));
    if (pieces.empty())
      throw_error(errc::invalid_argument,
                  "the checkpoint of step " + std::to_string(index.step) + " has no per-rank entry '" + name + "' of rank " + std::to_string(r),
                  {.operation = "ckpt.load", .object = name});
    out[r].resize(static_cast<std::size_t>(pieces.front().piece->nbytes()));
    detail::read_verified(sink, pieces.front(), 0, out[r].size(), out[r], scratch);
  }
  return out;
}

}  // namespace shardkit::ckpt
