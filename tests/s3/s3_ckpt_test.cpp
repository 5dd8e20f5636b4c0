// Checkpoints on S3: ckpt::checkpointer over the S3 sink against the test server (s3rver), thread ranks on a
// loopback world. Save from 3 ranks and load at 3 and resharded 3 -> 2 and 2 -> 4, bit for bit; every object
// byte-identical to what the posix_sink writes for the same state and step; loads that never LIST (a sink that
// refuses LIST during the load) and read only the index and the files it names; retention through DeleteObjects
// (remove_many) leaving exactly the kept checkpoints, no debris and no pending multipart upload; the same through
// a proxy failing 10% of requests (503 SlowDown, 500, resets, slow, stalled); and wrong credentials failing the
// save's completion at once with a clear error and no secret in it.
#include <doctest/doctest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "s3/fault_proxy.hpp"
#include "s3/s3_fixtures.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "support/harness.hpp"
#include "ckpt/ckpt_fixtures.hpp"

using namespace s3_test;
namespace sk = shardkit;
namespace ck = shardkit::ckpt;

namespace {

using shardkit::test::ckpt::rank_state;

// A sink in front of another that records what a load reads, can refuse LIST, and counts deletions. It has
// remove_many, forwarded to the inner sink's (the S3 sink's DeleteObjects, through any_sink).
struct watched_sink {
  using sink_concept = st::sink_tag;
  struct record {
    std::mutex mutex;
    std::atomic<bool> refuse_list{false};
    std::set<std::string> read;  // keys of get/size/exists
    int lists = 0, removes = 0;
    std::vector<std::vector<std::string>> batches;
    std::function<void(const std::string&)> before_remove;  // may throw: cuts a move between its copy and delete
  };
  st::any_sink inner;
  std::shared_ptr<record> rec = std::make_shared<record>();

  explicit watched_sink(st::any_sink s) : inner(std::move(s)) {}
  st::any_object_writer put(const std::string& key) { return inner.put(key); }
  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    note(key);
    return inner.get(key, offset, out);
  }
  std::optional<std::uint64_t> size(const std::string& key) {
    note(key);
    return inner.size(key);
  }
  bool exists(const std::string& key) {
    note(key);
    return inner.exists(key);
  }
  std::vector<std::string> list(const std::string& prefix) {
    if (rec->refuse_list)
      sk::throw_error(errc::io, "LIST refused by the test: a load must find its files through the index",
                      {.operation = "sink.list", .object = prefix});
    {
      std::lock_guard lock(rec->mutex);
      ++rec->lists;
    }
    return inner.list(prefix);
  }
  bool remove(const std::string& key) {
    if (!ck::detail::is_location_probe_key(key)) {
      std::lock_guard lock(rec->mutex);
      ++rec->removes;
    }
    if (rec->before_remove) rec->before_remove(key);
    return inner.remove(key);
  }
  void remove_many(std::span<const std::string> keys) {
    {
      std::lock_guard lock(rec->mutex);
      rec->batches.emplace_back(keys.begin(), keys.end());
    }
    inner.remove_many(keys);
  }

 private:
  // The object each checkpointer writes at construction and removes again so that every rank shows it sees rank 0's
  // storage (checkpointing.md, "One storage for every rank"): not a save's or a load's, so not counted here.
  void note(const std::string& key) {
    if (ck::detail::is_location_probe_key(key)) return;
    std::lock_guard lock(rec->mutex);
    rec->read.insert(key);
  }
};
static_assert(st::sink_removes_many<watched_sink>);

// Saves the state of each step from `world` thread ranks, as run "s3" unless `o` names one (so that two sinks'
// indexes are the same bytes); every save must commit.
void save_on(int world, st::any_sink sink, const std::vector<std::uint64_t>& steps, ck::checkpointer_options o = {}) {
  if (o.run_id.empty()) o.run_id = "s3";
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int r) {
    rank_state s(r, world);
    ck::checkpointer saver(groups[std::size_t(r)], sink, o);
    for (auto step : steps) {
      s.fill(step, r);
      const auto result = saver.save(step, s.dict, {{"run", "s3"}}).get();
      CHECK_MESSAGE(result.committed, result.reason);
    }
  });
}

// Loads the checkpoint of `step` into `world` thread ranks (load(step): no LIST needed) and checks every element.
void load_and_check(int world, st::any_sink sink, std::uint64_t step, const std::string& prefix = {}) {
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int r) {
    rank_state s(r, world);
    ck::checkpointer loader(groups[std::size_t(r)], sink, {.prefix = prefix});
    const auto report = loader.load(step, s.dict);
    CHECK(report.step == step);
    CHECK(report.metadata.at("run") == "s3");
    CHECK(report.rank_entries_loaded == (report.saved_world_size == std::uint32_t(world)));
    s.check(step, r, report.rank_entries_loaded);
  });
}

// The keys an index names: itself and its files.
std::set<std::string> keys_of(const ck::checkpoint_index& index, const std::string& prefix) {
  std::set<std::string> out{ck::index_key(prefix, index.step)};
  for (const auto& f : index.files) out.insert(f.key);
  return out;
}

// Every object of `a` is in `b` with the same bytes, and the other way round.
void check_same_objects(st::any_sink a, st::any_sink b) {
  const auto keys = a.list("");
  REQUIRE(keys == b.list(""));
  for (const auto& k : keys) {
    CAPTURE(k);
    CHECK(st::get_object(a, k) == st::get_object(b, k));
  }
}

// Test options with parts of 256 KiB, 3 in flight: each rank's file (~0.9 MB at 3 ranks) is a parallel multipart
// upload and each load's larger ranges are parallel ranged GETs.
st::s3_options multipart_options() {
  auto o = options_for(*server());
  o.part_size = 256 << 10;
  o.parallel = 3;
  return o;
}

}  // namespace

TEST_CASE("[s3] checkpoint: 3 ranks save, load at 3 and 3 -> 2 bit-exact, objects byte-identical to posix, loads never LIST") {
  if (!server_or_skip()) return;
  auto s3 = std::make_shared<st::s3_sink>(location("ckpt"), multipart_options());
  auto watched = std::make_shared<watched_sink>(st::any_sink(s3));
  st::any_sink sink(watched);
  save_on(3, sink, {10});
  CHECK(s3->pending_uploads().empty());

  // The same state and step through the posix sink: the same keys, the same bytes, index included.
  temp_dir dir;
  auto posix = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.fsync = false});
  save_on(3, posix, {10});
  check_same_objects(st::any_sink(s3), posix);
  const auto index = ck::read_index(*s3, "", 10);
  REQUIRE(index);
  CHECK(index->world_size == 3);
  const auto posix_keys = posix.list("");
  CHECK(keys_of(*index, "") == std::set<std::string>(posix_keys.begin(), posix_keys.end()));

  // Loads with LIST refused: they read the location's lease (a checkpointer that saves takes it before it loads),
  // the index, then only the files it names.
  watched->rec->refuse_list = true;
  watched->rec->read.clear();
  load_and_check(3, sink, 10);
  load_and_check(2, sink, 10);
  auto read = keys_of(*index, "");
  read.insert(ck::lease_key(""));
  CHECK(watched->rec->read == read);
  watched->rec->refuse_list = false;

  // load_latest finds the step by listing indexes (the only LIST a load makes), then loads the same way.
  auto groups = sk::comm::make_loopback_world(2);
  sk::test::run_threads(2, [&](int r) {
    rank_state s(r, 2);
    ck::checkpointer loader(groups[std::size_t(r)], sink);
    const auto report = loader.load_latest(s.dict);
    REQUIRE(report);
    CHECK(report->saved_world_size == 3);
    s.check(10, r, false);
  });
}

TEST_CASE("[s3] checkpoint: 2 ranks save, 4 ranks load bit-exact without LIST") {
  if (!server_or_skip()) return;
  auto s3 = std::make_shared<st::s3_sink>(location("ckpt-2to4"), multipart_options());
  auto watched = std::make_shared<watched_sink>(st::any_sink(s3));
  st::any_sink sink(watched);
  save_on(2, sink, {7});
  watched->rec->read.clear();  // the save's (its lease); what follows is the loads'
  watched->rec->refuse_list = true;
  load_and_check(4, sink, 7);
  load_and_check(2, sink, 7);
  const auto index = ck::read_index(*s3, "", 7);
  REQUIRE(index);
  auto read = keys_of(*index, "");
  read.insert(ck::lease_key(""));  // taken before the load reads anything
  CHECK(watched->rec->read == read);
}

TEST_CASE("[s3] checkpoint retention: keep_last 2 after 4 saves leaves 2 indexes and their files, through DeleteObjects") {
  if (!server_or_skip()) return;
  auto s3 = std::make_shared<st::s3_sink>(location("ckpt-retention"), multipart_options());
  auto watched = std::make_shared<watched_sink>(st::any_sink(s3));
  const std::string prefix = "run-1/";
  save_on(3, st::any_sink(watched), {100, 200, 300, 400}, {.prefix = prefix, .keep_last = 2});

  CHECK(ck::complete_checkpoints(*s3, prefix) == std::vector<std::uint64_t>{300, 400});
  std::set<std::string> expected;
  for (std::uint64_t step : {300, 400}) {
    const auto index = ck::read_index(*s3, prefix, step);
    REQUIRE(index);
    CHECK(index->files.size() == 3);
    expected.merge(keys_of(*index, prefix));
  }
  const auto all = s3->list("");
  CHECK(std::set<std::string>(all.begin(), all.end()) == expected);  // nothing else: no debris
  CHECK(all.size() == 8);
  CHECK(s3->pending_uploads().empty());
  // The batch path: steps 100 and 200 went in DeleteObjects requests (indexes first, then files), never one
  // DeleteObject per key; the one remove() is the lease's, released when the run ends.
  CHECK(watched->rec->removes == 1);
  REQUIRE(watched->rec->batches.size() == 4);
  CHECK(watched->rec->batches[0] == std::vector<std::string>{ck::index_key(prefix, 100)});
  CHECK(watched->rec->batches[1].size() == 3);
  CHECK(watched->rec->batches[2] == std::vector<std::string>{ck::index_key(prefix, 200)});
  CHECK(watched->rec->batches[3].size() == 3);
  load_and_check(3, st::any_sink(watched), 400, prefix);
  load_and_check(2, st::any_sink(watched), 300, prefix);
}

TEST_CASE("[s3] a resume past a damaged latest step moves it aside (copied, then deleted), also when a move was cut "
          "between a copy and its delete, and saves that step again") {
  if (!server_or_skip()) return;
  auto s3 = std::make_shared<st::s3_sink>(location("ckpt-damaged"), options_for(*server()));
  const std::string prefix = "run-1/", from = ck::step_prefix(prefix, 4), aside = prefix + "step-000000000004.damaged/";
  save_on(2, st::any_sink(s3), {2, 4}, {.prefix = prefix});
  auto damaged = st::get_object(*s3, ck::rank_file_key(prefix, 4, 1));
  damaged[damaged.size() - 100] ^= std::byte{0x5a};
  st::put_object(*s3, ck::rank_file_key(prefix, 4, 1), damaged);
  // Three runs resume past step 4 and save it again. The move of the first stops after copying the first file, that
  // of the second after copying the index (their DeleteObject never goes out, as when the process dies there), so
  // their saves of step 4 are refused; the third finishes the move into the same prefix and saves step 4.
  for (const std::string cut : {"rank-00000.safetensors", "index.json", ""}) {
    CAPTURE(cut);
    auto watched = std::make_shared<watched_sink>(st::any_sink(s3));
    watched->rec->before_remove = [&](const std::string& key) {
      if (key == from + cut) sk::throw_error(errc::io, "the test cuts the move here", {.operation = "sink.remove", .object = key});
    };
    auto groups = sk::comm::make_loopback_world(2);
    sk::test::run_threads(2, [&](int r) {
      rank_state s(r, 2);
      ck::checkpointer c(groups[std::size_t(r)], st::any_sink(watched), {.prefix = prefix, .run_id = "s3"});
      const auto report = c.load_latest(s.dict);
      REQUIRE(report);
      CHECK(report->step == 2);
      CHECK(report->passed_over.size() == 1);
      s.fill(4, r);
      bool committed = false;
      try {
        committed = c.save(4, s.dict, {{"run", "s3"}}).get().committed;
      } catch (const sk::error& e) {  // refused: step 4's index still stands
        CHECK(std::string(e.what()).find("step 4 already holds a checkpoint") != std::string::npos);
      }
      CHECK(committed == cut.empty());
    });
    if (!cut.empty()) {
      CHECK(s3->exists(aside + cut));  // copied, and still in the step
      CHECK(s3->exists(from + cut));
    }
  }
  const auto listed = ck::list_checkpoints(*s3, prefix);
  CHECK(listed.indexed == std::set<std::uint64_t>{2, 4});
  REQUIRE(listed.damaged.size() == 1);
  CHECK(listed.damaged.begin()->first == aside);
  CHECK(listed.damaged.begin()->second.keys.size() == 3);
  CHECK(st::get_object(*s3, aside + "rank-00001.safetensors") == damaged);
  load_and_check(2, st::any_sink(s3), 4, prefix);
}

TEST_CASE("[s3] checkpoint through a proxy failing 10% of requests: saves commit, loads return identical bytes") {
  if (!server_or_skip()) return;
  const auto& srv = *server();
  fault_proxy proxy(port_of(srv.endpoint), 0.10, 20261124);
  const auto loc = location("ckpt-faults");
  auto faulty = std::make_shared<st::s3_sink>(loc, through_faulty_proxy(srv, proxy.port()));
  auto direct = std::make_shared<st::s3_sink>(loc, options_for(srv));  // the same objects, not through the proxy
  auto watched = std::make_shared<watched_sink>(st::any_sink(faulty));

  save_on(3, st::any_sink(watched), {1, 2, 3, 4}, {.keep_last = 2});
  CHECK(ck::complete_checkpoints(*direct, "") == std::vector<std::uint64_t>{3, 4});
  CHECK(direct->list("").size() == 8);  // two indexes and their three files each
  // A CreateMultipartUpload whose reply the proxy lost leaves the upload it created behind, without a part (the
  // retry made another; docs/s3.md, "an ambiguous commit"), rarely at these rates. Retention aborts the
  // temporaries of every step older than the one it commits, so nothing else may be pending: no upload that
  // received a part, none of an older step.
  for (const auto& t : direct->temporaries("")) {
    CHECK_MESSAGE(t.bytes == 0, "a pending upload holding parts: " << t.key);
    CHECK_MESSAGE(ck::detail::step_of_key(t.key, "") == std::optional<std::uint64_t>(4),
                  "a pending upload of an older step: " << t.key);
  }
  CHECK(watched->rec->removes == 1);  // the lease's

  // The bytes through the faults are the server's, and the server's are the posix sink's for the same saves.
  temp_dir dir;
  auto posix = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.fsync = false});
  save_on(3, posix, {1, 2, 3, 4}, {.keep_last = 2});
  check_same_objects(st::any_sink(faulty), st::any_sink(direct));
  check_same_objects(st::any_sink(direct), posix);

  watched->rec->refuse_list = true;
  load_and_check(3, st::any_sink(watched), 4);
  load_and_check(2, st::any_sink(watched), 3);

  const auto counts = proxy.counts();
  std::string summary;
  int faults = 0;
  for (const auto& [f, n] : counts) {
    summary += std::string(name_of(f)) + ": " + std::to_string(n) + "; ";
    if (f != fault::none) faults += n;
  }
  MESSAGE("proxy: " << proxy.requests() << " requests; " << summary);
  CHECK(faults >= 6);  // each kind at least once
}

TEST_CASE("[s3] checkpoint with wrong credentials: the save fails at once naming bucket, key and operation, no secret") {
  if (!server_or_skip()) return;
  const std::string secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY", key_id = "AKIAWRONGKEYID77";
  auto o = options_for(*server());
  o.max_attempts = 8;
  o.base_backoff = std::chrono::milliseconds(200);  // 8 attempts of this would take seconds
  o.credentials = st::s3_credentials{key_id, secret, ""};
  const auto loc = location("ckpt-auth");
  auto bad = st::make_sink<st::s3_sink>(loc, o);
  auto groups = sk::comm::make_loopback_world(2);
  std::vector<std::string> messages(2);
  const auto t0 = std::chrono::steady_clock::now();
  sk::test::run_threads(2, [&](int r) {
    rank_state s(r, 2);
    s.fill(5, r);
    ck::checkpointer saver(groups[std::size_t(r)], bad);
    messages[std::size_t(r)] = error_of([&] { saver.save(5, s.dict); }, errc::io);
  });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 3.0);  // no retry storm: a 403 is not retried
  for (int r = 0; r < 2; ++r) {
    const auto& m = messages[std::size_t(r)];
    CAPTURE(m);
    // The first save's first request is rank 0's look at the location's lease, before any rank writes: the one the
    // server refuses, and every rank's save() throws it at once.
    CHECK(contains(m, "opening the checkpoint location for this run's saves"));
    CHECK(contains(m, "s3://" + loc.bucket + "/" + loc.prefix + "lease.json"));  // bucket and key
    if (&m == &messages[1]) CHECK(contains(m, "(on rank 0)"));
    CHECK(contains(m, "HeadObject"));  // the operation
    CHECK(contains(m, "403"));
    CHECK(contains(m, "not retried"));
    CHECK_FALSE(contains(m, secret));
    CHECK_FALSE(contains(m, key_id));
    CHECK_FALSE(contains(m, "S3RVER"));
  }
  // Nothing was written: the server holds nothing under the prefix.
  st::s3_sink good(loc, options_for(*server()));
  CHECK(good.list("").empty());
  CHECK(good.pending_uploads().empty());
}

TEST_CASE("[s3] a location whose rank files' keys pass S3's 1,024 bytes is refused when the checkpointer is made") {
  st::s3_options o;  // no server needed: nothing is sent
  o.endpoint = "http://127.0.0.1:1";
  o.credentials = st::s3_credentials{"ID", "SECRET", ""};
  const std::string long_prefix = std::string(990, 'p') + "/";
  auto sink = st::make_sink<st::s3_sink>(st::s3_location{"bucket", long_prefix}, o);
  auto groups = sk::comm::make_loopback_world(2);
  sk::test::run_threads(2, [&](int r) {
    const auto what = error_of([&] { ck::checkpointer c(groups[std::size_t(r)], sink, {.location = "s3://bucket/" + long_prefix}); },
                               errc::invalid_argument);
    CHECK(contains(what, "the checkpoint location 's3://bucket/" + long_prefix + "' is too long for its sink: the longest key "
                         "a save writes there, 'step-999999999999/rank-00001.safetensors' is 40 bytes, over the 33 this sink "
                         "allows (S3 keys are at most 1024 bytes, and this sink's prefix '" + long_prefix + "' takes 991 of them)"));
  });
}

TEST_CASE("[s3] a checkpoint file is a sized put: its parts grow to fit the server's part count") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 4096;
  o.max_parts = 2;  // S3's 10,000 made small: 2 parts of 4 KiB could not hold this file
  st::any_sink s = st::make_sink<st::s3_sink>(location("ckpt-sized"), o);
  std::vector<float> values(5000);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  const auto bytes = std::as_bytes(std::span(values));
  const auto table = ck::write_safetensors(s, "rank-0.safetensors", {ck::whole_tensor("w", shardkit::dtype::f32, {5000}, bytes)});
  CHECK(s.size("rank-0.safetensors") == table.file_size);
  CHECK(ck::read_header(s, "rank-0.safetensors").tensors.size() == 1);
}

TEST_CASE("[s3] a save is committed only when its index reads back") {
  if (!server_or_skip()) return;
  // A server whose HEAD of the index says 0 bytes from the index's upload on: the index never reads back whole.
  // (Before the upload the HEAD goes through: each rank first checks that the step holds no index yet.)
  fault_proxy proxy(port_of(server()->endpoint), 0.0, 1);
  auto index_sent = std::make_shared<std::atomic<bool>>(false);
  proxy.intercept([index_sent](const std::string& head) -> std::optional<std::string> {
    if (head.find("/index.json") == std::string::npos) return std::nullopt;
    if (head.starts_with("PUT ") || head.starts_with("POST ")) *index_sent = true;
    if (head.starts_with("HEAD ") && *index_sent)
      return std::string("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
    return std::nullopt;
  });
  auto o = options_for(*server());
  o.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  const auto loc = location("ckpt-readback");
  auto sink = st::make_sink<st::s3_sink>(loc, o);
  auto groups = sk::comm::make_loopback_world(2);
  sk::test::run_threads(2, [&](int r) {
    rank_state s(r, 2);
    s.fill(7, r);
    ck::checkpointer saver(groups[std::size_t(r)], sink, {.readback_timeout = std::chrono::milliseconds(300)});
    auto done = saver.save(7, s.dict);
    const auto m = error_of([&] { done.get(); }, errc::io);
    CAPTURE(m);
    CHECK(contains(m, "checkpoint of step 7 was not committed"));
    CHECK(contains(m, "did not read back"));
    CHECK(saver.stats().failed == 1);
  });
}

namespace {
// The S3 sink with good keys until `revoked`, then the same location with keys the server rejects (403): keys
// revoked in the middle of a run. (A signature-verifying front for the test server would revoke them there.)
struct revocable_sink {
  using sink_concept = st::sink_tag;
  st::any_sink good, rejected;
  std::shared_ptr<std::atomic<bool>> revoked = std::make_shared<std::atomic<bool>>(false);
  st::any_sink& now() { return *revoked ? rejected : good; }
  st::any_object_writer put(const std::string& key) { return now().put(key); }
  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) { return now().get(key, offset, out); }
  std::optional<std::uint64_t> size(const std::string& key) { return now().size(key); }
  bool exists(const std::string& key) { return now().exists(key); }
  std::vector<std::string> list(const std::string& prefix) { return now().list(prefix); }
  bool remove(const std::string& key) { return now().remove(key); }
};
}  // namespace

TEST_CASE("[s3] checkpoint: keys revoked mid-run: the next save throws on every rank, naming the step and the 403") {
  if (!server_or_skip()) return;
  const auto loc = location("ckpt-revoked");
  auto o = options_for(*server());
  auto good = st::make_sink<st::s3_sink>(loc, o);
  o.credentials = st::s3_credentials{"AKIAREVOKEDKEY77", "revoked-secret-revoked-secret-revoked00", ""};
  auto sink = std::make_shared<revocable_sink>(revocable_sink{good, st::make_sink<st::s3_sink>(loc, o)});
  auto groups = sk::comm::make_loopback_world(2);
  std::vector<std::uint64_t> stopped_at(2, 0);
  std::vector<std::string> messages(2);
  sk::test::run_threads(2, [&](int r) {
    rank_state s(r, 2);
    ck::checkpointer saver(groups[std::size_t(r)], st::any_sink(sink), {.mode = ck::staging::zero_overhead});
    try {
      for (std::uint64_t step = 1; step <= 12; ++step) {
        groups[std::size_t(r)].barrier().wait();  // training's collectives
        if (step == 4 && r == 0) *sink->revoked = true;
        saver.wait_staged();
        s.fill(step, r);
        if (step == 3) CHECK(saver.save(step, s.dict).get().committed);
        else saver.save(step, s.dict);
      }
      saver.wait();
    } catch (const sk::error& e) {
      messages[std::size_t(r)] = e.what();
      stopped_at[std::size_t(r)] = saver.stats().saves;
    }
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(messages[std::size_t(r)]);
    CHECK(contains(messages[std::size_t(r)], "checkpoint of step 4 was not committed"));
    CHECK(contains(messages[std::size_t(r)], "403"));
  }
  // Both ranks stopped at the same call, by the time save 4 had ended everywhere (wait_staged after save 6).
  CHECK(stopped_at[0] == stopped_at[1]);
  CHECK(stopped_at[0] >= 4);
  CHECK(stopped_at[0] <= 6);
  CHECK(ck::complete_checkpoints(good, "").back() == 3);
}

TEST_CASE("[s3] two runs on one prefix: the second is refused naming the holder; a replaced lease stops the first's commits") {
  if (!server_or_skip()) return;
  const auto loc = location("ckpt-lease");
  auto s3 = std::make_shared<st::s3_sink>(loc, options_for(*server()));
  // What this server makes of If-None-Match on PutObject: S3, MinIO and Ceph refuse the second create (412); s3rver
  // ignores the header and replaces the object. Either way the lease is read back, and re-read before each commit.
  CHECK(s3->put_new("probe", st::as_bytes("1")));
  const bool honours = !s3->put_new("probe", st::as_bytes("2"));
  MESSAGE("this S3 server " << (honours ? "honours" : "ignores") << " If-None-Match: * on PutObject");
  s3->remove("probe");
  st::any_sink sink(s3);
  auto a = sk::comm::make_loopback_world(2), b = sk::comm::make_loopback_world(2);
  std::barrier step(4);
  std::atomic<int> refused{0}, stopped{0};
  sk::test::run_threads(4, [&](int t) {
    const int r = t % 2;
    rank_state s(r, 2);
    if (t < 2) {  // run A holds the prefix
      ck::checkpointer c(a[std::size_t(r)], sink, {.run_id = "run-a"});
      s.fill(1, r);
      CHECK(c.save(1, s.dict).get().committed);
      step.arrive_and_wait();
      step.arrive_and_wait();  // B was refused; then a second writer's lease replaces A's (what a race on a server
                               // that ignores If-None-Match leaves): A's next commit is refused on every rank
      if (r == 0) {
        const ck::lease_record intruder{"run-b", "b-holder", "other-host", 4242, ck::detail::unix_seconds()};
        st::put_object(*s3, ck::lease_key(""), st::as_bytes(intruder.to_json()));
      }
      c.group().barrier().wait();
      s.fill(2, r);
      try {
        c.save(2, s.dict).get();
      } catch (const sk::error& e) {
        const std::string what = e.what();
        INFO(what);
        CHECK(contains(what, "this run (run-a) no longer holds the checkpoint location: it is held by run run-b (host other-host, pid 4242"));
        ++stopped;
      }
    } else {
      step.arrive_and_wait();
      ck::checkpointer c(b[std::size_t(r)], sink, {.run_id = "run-b"});
      s.fill(2, r);
      try {
        c.save(2, s.dict);
      } catch (const sk::error& e) {
        const std::string what = e.what();
        INFO(what);
        CHECK(contains(what, "is held by run run-a (host "));
        ++refused;
      }
      step.arrive_and_wait();
    }
  });
  CHECK(refused == 2);
  CHECK(stopped == 2);
  CHECK(ck::complete_checkpoints(*s3, "") == std::vector<std::uint64_t>{1});
  CHECK(s3->pending_uploads().empty());
}

namespace {
// A multipart upload of `key` left pending as a writer killed mid-save leaves it: two parts of 4 KiB sent, then the
// writer's AbortMultipartUpload answered by a proxy that drops it (the process is gone). Its upload id.
std::string leave_pending_upload(const st::s3_location& loc, const std::string& key) {
  fault_proxy proxy(port_of(server()->endpoint), 0.0, 1);
  proxy.intercept([](const std::string& head) -> std::optional<std::string> {
    if (head.starts_with("DELETE ")) return std::string("HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n");
    return std::nullopt;
  });
  auto o = options_for(*server());
  o.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  o.part_size = 4096;
  st::s3_sink sink(loc, o);
  {
    auto w = sink.put(key);
    const std::vector<std::byte> bytes(2 * 4096 + 100, std::byte{7});
    w.write(bytes);  // parts 1 and 2 sent, part 3 buffered: the writer dies here
  }
  for (const auto& u : sink.pending_uploads(key))
    if (u.key == key) return u.upload_id;
  FAIL("no pending upload of " << key);
  return {};
}

// s3rver keeps an upload as files (its key, its parts): their times are its Initiated and its parts' LastModified.
void age_upload(const std::string& upload_id, std::chrono::seconds age) {
  const std::filesystem::path dir = std::filesystem::path(server()->data_dir) / server()->bucket / "._S3rver_uploads" / upload_id;
  REQUIRE(std::filesystem::is_directory(dir));
  for (const auto& f : std::filesystem::directory_iterator(dir))
    std::filesystem::last_write_time(f.path(), std::filesystem::last_write_time(f.path()) - age);
}

std::set<std::string> pending_keys(st::s3_sink& s3) {
  std::set<std::string> out;
  for (const auto& u : s3.pending_uploads()) out.insert(u.key);
  return out;
}
}  // namespace

TEST_CASE("[s3] no orphans: a killed save's pending upload is aborted when the next run takes the location, a live save's stays") {
  if (!server_or_skip()) return;
  if (server()->data_dir.empty()) {
    MESSAGE("[s3] no s3rver data directory (SHARDKIT_TEST_S3RVER_DATA): cannot age an upload; case skipped");
    return;
  }
  const auto loc = location("ckpt-orphans");
  auto s3 = std::make_shared<st::s3_sink>(loc, options_for(*server()));
  const std::string dead = ck::rank_file_key("", 1, 0), live = ck::rank_file_key("", 3, 1);
  age_upload(leave_pending_upload(loc, dead), std::chrono::hours(1));  // an earlier run's, killed
  leave_pending_upload(loc, live);  // another process's save, still sending parts
  const auto temporaries = s3->temporaries("");
  REQUIRE(temporaries.size() == 2);
  for (const auto& t : temporaries) CHECK(t.bytes == 2 * 4096);
  CHECK(pending_keys(*s3) == std::set<std::string>{dead, live});
  {  // a checkpointer that only loads (it never takes the location's lease) removes nothing
    auto groups = sk::comm::make_loopback_world(1);
    ck::checkpointer reader(groups[0], st::any_sink(s3));
  }
  CHECK(pending_keys(*s3) == std::set<std::string>{dead, live});
  for (int world : {1, 3}) {
    auto groups = sk::comm::make_loopback_world(world);
    sk::test::run_threads(world, [&](int r) {
      ck::checkpointer c(groups[std::size_t(r)], st::any_sink(s3));
      c.open_for_saves();
    });
    CHECK(pending_keys(*s3) == std::set<std::string>{live});
  }
  s3->abort_pending_uploads();
}
