#pragma once
//! The data loader's state: what one rank's loader has delivered, as plain values and as a versioned, checksummed
//! byte blob. The blob is what a checkpoint stores (one object per rank); loader::load takes every rank's blob back,
//! so a different world size can redistribute the logical shards (docs/data.md has the format and the rule).
//!
//! Everything a logical shard needs to continue its stream exactly lives in its shard_state: per dataset the epoch,
//! the RNG state, the shuffle key and the position in the shuffled order, the mixing counter; and the packing
//! carry (the document cut by the last sequence's end and how much of it went out). The carry is a cursor into the
//! token file, not a copy of tokens, so a state stays a few dozen bytes per logical shard.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/codec/xxh64.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::data {

//! The blob's format version. Version 2 adds the configuration's named fields; a parser reads 1 and 2.
inline constexpr std::uint32_t state_version = 2;
inline constexpr char state_magic[8] = {'S', 'K', 'D', 'A', 'T', 'A', 'S', 'T'};

//! One dataset's part of one logical shard.
struct dataset_cursor {
  std::uint64_t epoch = 0;      //!< epochs of this part completed
  std::uint64_t rng = 0;        //!< splitmix64 state: each epoch's shuffle key is drawn from it
  std::uint64_t key = 0;        //!< this epoch's shuffle key
  std::uint64_t chunk = 0;      //!< position in this epoch's (shuffled) chunk order
  std::uint64_t document = 0;   //!< position in the current chunk's (shuffled) document order
  std::uint64_t delivered = 0;  //!< mixing counter: tokens delivered since the weights last changed
  bool exhausted = false;       //!< every epoch delivered (finite epochs), or this part holds no document
  bool operator==(const dataset_cursor&) const = default;
};

//! One logical shard: its datasets' cursors and its packing carry.
struct shard_state {
  std::uint32_t id = 0;
  std::uint64_t sequences = 0;     //!< sequences this shard has delivered
  std::int32_t open_dataset = -1;  //!< the dataset whose current document the last sequence cut, or -1
  std::uint64_t open_offset = 0;   //!< framed tokens (BOS + document + EOS) of that document already delivered
  std::vector<dataset_cursor> datasets;
  bool operator==(const shard_state&) const = default;
};

//! One rank's state.
struct rank_state {
  std::uint32_t rank = 0;
  std::uint32_t world = 1;
  std::uint32_t logical_shards = 0;
  std::uint64_t fingerprint = 0;  //!< of the loader's configuration (datasets, files, packing, seed): must match at load
  //! The same configuration as named text fields (long values shortened, with a digest of the whole), so that a load
  //! with another configuration names the field that changed and both values. Empty from a version 1 blob.
  std::vector<std::pair<std::string, std::string>> configuration;
  std::vector<double> weights;    //!< the mixing weights in force
  std::vector<shard_state> shards;  //!< the logical shards this rank owns, by id
  bool operator==(const rank_state&) const = default;
};

namespace detail {

class blob_writer {
 public:
  void u8(std::uint8_t v) { bytes_.push_back(static_cast<std::byte>(v)); }
  void u32(std::uint32_t v) { raw(&v, 4); }
  void u64(std::uint64_t v) { raw(&v, 8); }
  void f64(double v) { u64(std::bit_cast<std::uint64_t>(v)); }
  void text(const std::string& t) {
    u32(static_cast<std::uint32_t>(t.size()));
    raw(t.data(), t.size());
  }
  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
  }
  std::vector<std::byte>& bytes() { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

class blob_reader {
 public:
  explicit blob_reader(std::span<const std::byte> b) : bytes_(b) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(take(1)[0]); }
  std::uint32_t u32() { return get<std::uint32_t>(); }
  std::uint64_t u64() { return get<std::uint64_t>(); }
  double f64() { return std::bit_cast<double>(u64()); }
  std::string text() {
    const std::uint32_t n = u32();
    const auto bytes = take(n);
    return std::string(reinterpret_cast<const char*>(bytes.data()), n);
  }
  std::size_t position() const { return at_; }
  std::size_t remaining() const { return bytes_.size() - at_; }

 private:
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof(T)).data(), sizeof(T));
    return v;
  }
  std::span<const std::byte> take(std::size_t n) {
    if (remaining() < n) bad_state("truncated: a field at byte " + std::to_string(at_) + " needs " + std::to_string(n) +
                                   " bytes, " + std::to_string(remaining()) + " remain");
    auto s = bytes_.subspan(at_, n);
    at_ += n;
    return s;
  }

 public:
  [[noreturn]] static void bad_state(const std::string& why) {
    throw_error(errc::invalid_argument, "data loader state blob: " + why, {.operation = "data.load"});
  }

 private:
  std::span<const std::byte> bytes_;
  std::size_t at_ = 0;
};

// magic (8) + version (4) + reserved (4) + payload size (8) ... payload ... + xxh64 of everything before (8)
inline constexpr std::size_t state_header_bytes = 24;

}  // namespace detail

//! The blob of a rank's state: little-endian, versioned, with an xxHash64 of its bytes at the end.
inline std::vector<std::byte> encode_state(const rank_state& s) {
  detail::blob_writer w;
  w.raw(state_magic, 8);
  w.u32(state_version);
  w.u32(0);
  w.u64(0);  // payload size, patched below
  w.u32(s.rank);
  w.u32(s.world);
  w.u32(s.logical_shards);
  w.u64(s.fingerprint);
  w.u32(static_cast<std::uint32_t>(s.configuration.size()));
  for (const auto& [name, value] : s.configuration) {
    w.text(name);
    w.text(value);
  }
  w.u32(static_cast<std::uint32_t>(s.weights.size()));
  for (double x : s.weights) w.f64(x);
  w.u32(static_cast<std::uint32_t>(s.shards.size()));
  for (const auto& sh : s.shards) {
    w.u32(sh.id);
    w.u64(sh.sequences);
    w.u32(static_cast<std::uint32_t>(sh.open_dataset));
    w.u64(sh.open_offset);
    w.u32(static_cast<std::uint32_t>(sh.datasets.size()));
    for (const auto& c : sh.datasets) {
      w.u64(c.epoch);
      w.u64(c.rng);
      w.u64(c.key);
      w.u64(c.chunk);
      w.u64(c.document);
      w.u64(c.delivered);
      w.u8(c.exhausted ? 1 : 0);
    }
  }
  auto& bytes = w.bytes();
  const std::uint64_t payload = bytes.size() - detail::state_header_bytes;
  std::memcpy(bytes.data() + 16, &payload, 8);
  const std::uint64_t sum = codec::xxh64(bytes);
  w.u64(sum);
  return std::move(w.bytes());
}

//! The strict inverse of encode_state: a wrong magic, version, size or checksum, a truncated field, trailing bytes
//! or inconsistent counts are errc::invalid_argument saying what is wrong.
inline rank_state decode_state(std::span<const std::byte> blob) {
  using detail::blob_reader;
  if (blob.size() < detail::state_header_bytes + 8)
    blob_reader::bad_state("too short (" + std::to_string(blob.size()) + " bytes): not a data loader state");
  if (std::memcmp(blob.data(), state_magic, 8) != 0) blob_reader::bad_state("wrong magic: not a data loader state");
  blob_reader header(blob.subspan(8, 16));
  const std::uint32_t version = header.u32();
  if (version != 1 && version != state_version)
    blob_reader::bad_state("version " + std::to_string(version) + " (this build reads versions 1 and " + std::to_string(state_version) + ")");
  (void)header.u32();
  const std::uint64_t payload = header.u64();
  if (payload != blob.size() - detail::state_header_bytes - 8)
    blob_reader::bad_state("the header announces " + std::to_string(payload) + " payload bytes but the blob holds " +
                           std::to_string(blob.size() - detail::state_header_bytes - 8) + " (truncated or padded)");
  std::uint64_t stored;
  std::memcpy(&stored, blob.data() + blob.size() - 8, 8);
  const std::uint64_t computed = codec::xxh64(blob.first(blob.size() - 8));
  if (stored != computed)
    blob_reader::bad_state("checksum mismatch (stored " + codec::checksum_to_hex(stored) + ", computed " +
                           codec::checksum_to_hex(computed) + "): the blob is corrupt");

  blob_reader r(blob.subspan(detail::state_header_bytes, payload));
  rank_state s;
  s.rank = r.u32();
  s.world = r.u32();
  s.logical_shards = r.u32();
  s.fingerprint = r.u64();
  if (s.world == 0 || s.rank >= s.world) blob_reader::bad_state("rank " + std::to_string(s.rank) + " of world " + std::to_string(s.world));
  if (version >= 2) {
    const std::uint32_t fields = r.u32();
    if (fields > r.remaining() / 8) blob_reader::bad_state("implausible configuration field count " + std::to_string(fields));
    for (std::uint32_t i = 0; i < fields; ++i) {
      std::string name = r.text();
      s.configuration.emplace_back(std::move(name), r.text());
    }
  }
  const std::uint32_t datasets = r.u32();
  if (datasets == 0 || datasets > r.remaining() / 8) blob_reader::bad_state("implausible dataset count " + std::to_string(datasets));
  for (std::uint32_t i = 0; i < datasets; ++i) s.weights.push_back(r.f64());
  const std::uint32_t shards = r.u32();
  if (shards > s.logical_shards) blob_reader::bad_state(std::to_string(shards) + " shards of " + std::to_string(s.logical_shards));
  for (std::uint32_t i = 0; i < shards; ++i) {
    shard_state sh;
    sh.id = r.u32();
    if (sh.id >= s.logical_shards || (!s.shards.empty() && sh.id <= s.shards.back().id))
      blob_reader::bad_state("logical shard id " + std::to_string(sh.id) + " out of range or order");
    sh.sequences = r.u64();
    sh.open_dataset = static_cast<std::int32_t>(r.u32());
    sh.open_offset = r.u64();
    if (sh.open_dataset < -1 || sh.open_dataset >= static_cast<std::int32_t>(datasets))
      blob_reader::bad_state("shard " + std::to_string(sh.id) + " packs dataset " + std::to_string(sh.open_dataset));
    const std::uint32_t n = r.u32();
    if (n != datasets)
      blob_reader::bad_state("shard " + std::to_string(sh.id) + " has " + std::to_string(n) + " dataset cursors, not " + std::to_string(datasets));
    for (std::uint32_t d = 0; d < n; ++d) {
      dataset_cursor c;
      c.epoch = r.u64();
      c.rng = r.u64();
      c.key = r.u64();
      c.chunk = r.u64();
      c.document = r.u64();
      c.delivered = r.u64();
      const std::uint8_t e = r.u8();
      if (e > 1) blob_reader::bad_state("a flag byte is " + std::to_string(e));
      c.exhausted = e == 1;
      sh.datasets.push_back(c);
    }
    s.shards.push_back(std::move(sh));
  }
  if (r.remaining() != 0) blob_reader::bad_state(std::to_string(r.remaining()) + " trailing bytes");
  return s;
}

}  // namespace shardkit::data
