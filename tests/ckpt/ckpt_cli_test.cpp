// shardkit-ckpt, the built binary, over a checkpoint that ckpt::checkpointer wrote from a 3-rank loopback world into
// a temporary directory: ls (steps, complete or debris, latest), verify (passes, then names the file, the tensor and
// the bytes of a flipped byte, exit 1), inspect (pieces per rank), consolidate (Hugging Face layout: one file, or
// shards by --max-shard-size with model.safetensors.index.json; whole tensors equal the saved pieces joined).
#include <doctest/doctest.h>

#include "ckpt_cli_fixtures.hpp"

using namespace shardkit::test::ckpt_cli;

TEST_CASE("[ckpt] shardkit-ckpt ls, verify, inspect and consolidate a 3-rank checkpoint") {
  temp_dir dir("main");
  write_checkpoints(dir.path);
  st::any_sink sink = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.create_root = false});
  const std::string loc = dir.path.string();

  SUBCASE("ls: every step, complete or debris, the latest marked") {
    const auto r = run_tool("ls " + loc);
    INFO("shardkit-ckpt said:\n", r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("3 steps, 2 complete checkpoints, latest step 2") != std::string::npos);
    const auto step1 = line_with(r.output, "\n1 "), step2 = line_with(r.output, "\n2 "), step3 = line_with(r.output, "\n3 ");
    CHECK(step1.find("complete") != std::string::npos);
    CHECK(step1.find("latest") == std::string::npos);
    CHECK(step2.find("complete") != std::string::npos);
    CHECK(step2.find("latest") != std::string::npos);
    CHECK(step2.find("run=cli-test") != std::string::npos);
    CHECK(step2.find("  3  ") != std::string::npos);  // world size and files
    CHECK(step3.find("debris") != std::string::npos);

    const auto j = run_tool("ls " + loc + " --json");
    REQUIRE(j.status == 0);
    const auto listing = nlohmann::json::parse(j.output);
    CHECK(listing["latest"] == 2);
    REQUIRE(listing["steps"].size() == 3);
    std::uint64_t on_disk = 0;
    for (const auto& e : fs::recursive_directory_iterator(dir.path / ck::step_prefix("", 2)))
      if (e.is_regular_file()) on_disk += e.file_size();
    CHECK(listing["steps"][1]["bytes"] == on_disk);
    CHECK(listing["steps"][1]["world_size"] == world);
    CHECK(listing["steps"][1]["status"] == "complete");
    CHECK(listing["steps"][2]["status"] == "debris");
    CHECK(listing["steps"][2]["world_size"].is_null());
  }

  SUBCASE("ls, inspect and verify say one size for a step: what its files and index take on storage") {
    std::uint64_t on_disk = 0;
    for (const auto& e : fs::recursive_directory_iterator(dir.path / ck::step_prefix("", 2)))
      if (e.is_regular_file()) on_disk += e.file_size();
    const auto ls = run_tool("ls " + loc), inspect = run_tool("inspect " + loc), verify = run_tool("verify " + loc);
    INFO("ls:\n", ls.output, "\ninspect:\n", inspect.output, "\nverify:\n", verify.output);
    const auto sizes = [](const std::string& text) {
      std::set<std::string> out;
      const std::regex size_re("([0-9.]+ (B|KiB|MiB|GiB))");
      for (auto it = std::sregex_iterator(text.begin(), text.end(), size_re); it != std::sregex_iterator(); ++it)
        out.insert((*it)[1]);
      return out;
    };
    const auto step2 = line_with(ls.output, "\n2 ");
    const auto in_ls = sizes(step2), in_inspect = sizes(line_with(inspect.output, "step 2 of")),
               in_verify = sizes(line_with(verify.output, "verifying step 2"));
    REQUIRE(in_ls.size() == 1);
    CHECK(in_inspect == in_ls);
    CHECK(in_verify == in_ls);
    CHECK(sizes(line_with(verify.output, "step 2:")).empty());  // the summary adds no other size for the step
    const auto j = nlohmann::json::parse(run_tool("inspect " + loc + " --json").output);
    CHECK(j["bytes"] == on_disk);
  }

  SUBCASE("ls, inspect and verify count the same tensors for a step (per-rank entries too); verify adds the pieces") {
    const auto ls = run_tool("ls " + loc + " --json"), inspect = run_tool("inspect " + loc), verify = run_tool("verify " + loc);
    INFO("inspect:\n", inspect.output, "\nverify:\n", verify.output);
    const auto index = *ck::read_index(sink, "", 2);
    std::size_t pieces = 0, per_rank = 0;
    for (const auto& f : index.files) pieces += f.pieces.size();
    for (const auto& t : index.tensors) per_rank += t.name.starts_with("rank/");
    REQUIRE(per_rank > 0);                     // what ls left out
    REQUIRE(pieces > index.tensors.size());    // what verify counted
    const std::string n = std::to_string(index.tensors.size());
    CHECK(nlohmann::json::parse(ls.output)["steps"][1]["tensors"] == index.tensors.size());
    CHECK(line_with(run_tool("ls " + loc).output, "\n2 ").find("  " + n + "  ") != std::string::npos);
    CHECK(line_with(inspect.output, " tensors; pieces are").starts_with(n + " tensors"));
    CHECK(line_with(verify.output, "step 2:").find(n + " tensors in " + std::to_string(pieces) + " pieces checked") !=
          std::string::npos);
  }

  SUBCASE("ls and verify: an index that does not parse, a file missing, records that disagree") {
    st::put_object(sink, ck::index_key("", 1), st::as_bytes("{\"format\": \"shardkit.ckpt\", \"version\": 1"));
    REQUIRE(sink.remove(ck::rank_file_key("", 2, 2)));
    auto r = run_tool("ls " + loc);
    INFO("shardkit-ckpt said:\n", r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("3 steps, 0 complete checkpoints, 2 damaged\n") != std::string::npos);  // no latest: none is whole
    CHECK(line_with(r.output, "\n1 ").find("bad-index") != std::string::npos);
    CHECK(line_with(r.output, "\n2 ").find("damaged") != std::string::npos);
    CHECK(line_with(r.output, "\n2 ").find("latest") == std::string::npos);
    CHECK(line_with(r.output, "note: step 1:").find("malformed checkpoint index") != std::string::npos);
    CHECK(line_with(r.output, "note: step 2:").find("rank-00002.safetensors is listed in its index but absent") != std::string::npos);

    r = run_tool("verify " + loc);
    CHECK(r.status == 1);
    CHECK(line_with(r.output, "FAIL").find("rank-00002.safetensors") != std::string::npos);
    CHECK(r.output.find("no such checkpoint file") != std::string::npos);
    const auto missing = line_with(r.output, "no such checkpoint file");
    CHECK_MESSAGE(missing.find("rank-00002") == missing.rfind("rank-00002"), "the file named once: ", missing);

    // The index says another checksum than the file's header (and the data) for one tensor.
    auto index = *ck::read_index(sink, "", 2);
    index.files[0].pieces[0].xxh64 ^= 1;
    st::put_object(sink, ck::index_key("", 2), st::as_bytes(ck::to_json(index)));
    r = run_tool("verify " + loc);
    const std::string name = index.tensor_of(index.files[0].pieces[0]).name;
    CHECK(r.status == 1);
    CHECK(line_with(r.output, "the file's header says xxh64").find("rank-00000.safetensors, tensor '" + name + "'") != std::string::npos);
    CHECK(line_with(r.output, "checksum mismatch").find("tensor '" + name + "'") != std::string::npos);

    r = run_tool("verify " + loc + "/" + ck::step_prefix("", 2));
    CHECK(r.status == 1);
    CHECK(r.output.find("give its parent and --step N") != std::string::npos);
  }

  SUBCASE("verify passes, then names the file, the tensor and the bytes of a flipped byte") {
    auto r = run_tool("verify " + loc + " --progress");
    INFO("shardkit-ckpt said:\n", r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("verifying step 2") != std::string::npos);
    CHECK(r.output.find(": OK") != std::string::npos);
    CHECK(r.output.find("100%") != std::string::npos);  // the progress bar, asked for without a terminal
    CHECK(run_tool("verify " + loc + " --step 1").status == 0);

    // A byte in the second checksum chunk of rank 1's piece of block0.w.
    const std::string key = ck::rank_file_key("", 2, 1);
    const auto table = ck::read_header(sink, key);
    const auto& t = table.at("block0.w");
    REQUIRE(t.nbytes() > ck::checksum_chunk_bytes + 1000);
    const std::uint64_t at = table.data_start() + t.data_begin + ck::checksum_chunk_bytes + 1000;
    {
      std::fstream f(dir.path / key, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(std::streamoff(at));
      char c = 0;
      f.read(&c, 1);
      c = char(c ^ 0x10);
      f.seekp(std::streamoff(at));
      f.write(&c, 1);
    }
    r = run_tool("verify " + loc);
    CHECK(r.status == 1);
    const auto error = line_with(r.output, "checksum mismatch");
    CHECK(error.find("rank-00001.safetensors") != std::string::npos);
    CHECK(error.find("'block0.w'") != std::string::npos);
    CHECK(error.find("bytes [" + std::to_string(ck::checksum_chunk_bytes) + ", " + std::to_string(t.nbytes()) + ")") != std::string::npos);
    CHECK(line_with(r.output, "rank-00001.safetensors").starts_with("FAIL"));
    CHECK(line_with(r.output, "rank-00000.safetensors").starts_with("ok"));
    CHECK(r.output.find("checked: 1 problem\n") != std::string::npos);
    CHECK(run_tool("verify " + loc + " --step 1").status == 0);  // the other checkpoint is untouched

    // consolidate refuses to write the bad bytes, naming the tensor.
    temp_dir out("bad");
    r = run_tool("consolidate " + loc + " --out " + out.path.string());
    CHECK(r.status == 1);
    CHECK(r.output.find("checksum mismatch") != std::string::npos);
    CHECK(r.output.find("block0.w") != std::string::npos);
    CHECK(!fs::exists(out.path / "model.safetensors"));

    // Nor does --force from it lose the model already there (one file, or shards and their index): nothing old
    // goes before every new byte is verified.
    for (const std::string shard_size : {"", " --max-shard-size 2MB"}) {
      INFO("the model already there was written with '", shard_size, "'");
      temp_dir kept("kept");
      REQUIRE(run_tool("consolidate " + loc + " --step 1 --out " + kept.path.string() + shard_size).status == 0);
      auto files_in = [&] {
        std::set<std::string> files;
        for (const auto& e : fs::directory_iterator(kept.path)) files.insert(e.path().filename().string());
        return files;
      };
      const auto before = files_in();
      r = run_tool("consolidate " + loc + " --out " + kept.path.string() + " --force");
      CHECK(r.status == 1);
      CHECK(r.output.find("checksum mismatch") != std::string::npos);
      CHECK(files_in() == before);
      std::vector<std::string> shards;
      for (const auto& f : before)
        if (f.ends_with(".safetensors")) shards.push_back(f);
      check_consolidated(kept.path, sink, 1, shards);
    }
  }

  SUBCASE("verify: a step without an index is not a checkpoint") {
    const auto r = run_tool("verify " + loc + " --step 3");
    INFO("shardkit-ckpt said:\n", r.output);
    CHECK(r.status == 1);
    CHECK(r.output.find("step 3 has no index") != std::string::npos);
    CHECK(r.output.find("debris") != std::string::npos);
  }

  SUBCASE("inspect: the tensor table with each rank's piece") {
    const auto r = run_tool("inspect " + loc + " --step 1");
    INFO("shardkit-ckpt said:\n", r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("step 1 of " + loc + ": world size 3, 3 files") != std::string::npos);
    const auto row = line_with(r.output, "block0.w ");
    CHECK(row.find("F32") != std::string::npos);
    CHECK(row.find("[1024, 1024]") != std::string::npos);
    CHECK(row.find("4.00 MiB") != std::string::npos);
    const std::size_t n = 1024 * 1024;
    CHECK(row.find("3: r0 [0, " + std::to_string(piece_begin(n, 1)) + ") r1 [" + std::to_string(piece_begin(n, 1)) + ", " +
                   std::to_string(piece_begin(n, 2)) + ") r2 [" + std::to_string(piece_begin(n, 2)) + ", " + std::to_string(n) + ")") !=
          std::string::npos);
    CHECK(line_with(r.output, "optim.steps").find("1: r0") != std::string::npos);  // replicated: rank 0 saves it
    CHECK(line_with(r.output, "optim.steps").find(" U64 ") != std::string::npos);  // a std::uint64_t value, not U8 [8]
    CHECK(line_with(r.output, "optim.steps").find(" [1] ") != std::string::npos);
    CHECK(line_with(r.output, "rank/2/loader").find("U8") != std::string::npos);

    const auto j = run_tool("inspect " + loc + " --step 1 --json");
    REQUIRE(j.status == 0);
    const auto table = nlohmann::json::parse(j.output);
    CHECK(table["step"] == 1);
    bool found = false;
    for (const auto& t : table["tensors"])
      if (t["name"] == "block0.w") {
        found = true;
        REQUIRE(t["pieces"].size() == 3);
        for (int rank = 0; rank < world; ++rank) {
          CHECK(t["pieces"][std::size_t(rank)]["rank"] == rank);
          CHECK(t["pieces"][std::size_t(rank)]["file"] == ck::rank_file_key("", 1, rank));
          CHECK(t["pieces"][std::size_t(rank)]["begin"] == piece_begin(n, rank));
          CHECK(t["pieces"][std::size_t(rank)]["end"] == piece_begin(n, rank + 1));
        }
      }
    CHECK(found);
  }

  SUBCASE("consolidate into one model.safetensors") {
    temp_dir out("one");
    auto r = run_tool("consolidate " + loc + " --out " + out.path.string());
    INFO("shardkit-ckpt said:\n", r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("left out 3 per-rank entries (rank/...) and 5 optimizer tensors") != std::string::npos);
    CHECK(!fs::exists(out.path / "model.safetensors.index.json"));
    const auto where = check_consolidated(out.path, sink, 2, {"model.safetensors"});
    CHECK(where.size() == model_tensors.size());  // no optim.*, no rank/*

    r = run_tool("consolidate " + loc + " --out " + out.path.string() + " --step 1");
    CHECK(r.status == 1);
    CHECK(r.output.find("already holds a consolidated model") != std::string::npos);
    r = run_tool("consolidate " + loc + " --out " + out.path.string() + " --step 1 --force --all");
    REQUIRE(r.status == 0);
    const auto all = check_consolidated(out.path, sink, 1, {"model.safetensors"});
    CHECK(all.contains("optim.exp_avg.block0.w"));
    CHECK(all.contains("optim.steps"));
    CHECK(all.contains("rank/1/loader"));
  }

  SUBCASE("consolidate into shards by --max-shard-size with model.safetensors.index.json") {
    temp_dir out("sharded");
    const std::uint64_t max = 2'000'000;
    const auto r = run_tool("consolidate " + loc + " --out " + out.path.string() + " --max-shard-size 2MB");
    INFO("shardkit-ckpt said:\n", r.output);
    REQUIRE(r.status == 0);
    std::ifstream in(out.path / "model.safetensors.index.json");
    REQUIRE(in);
    const auto index = nlohmann::json::parse(in);
    REQUIRE(index.contains("metadata"));
    REQUIRE(index.contains("weight_map"));
    std::set<std::string> files;
    for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
    const std::size_t n = files.size();
    CHECK(n == 3);  // block0.w (4 MiB) alone; the small tensors around it
    std::uint64_t total = 0;
    for (const auto& t : model_tensors) total += t.numel() * sizeof(float);
    CHECK(index["metadata"]["total_size"].get<std::uint64_t>() == total);
    for (std::size_t i = 1; i <= n; ++i) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i, n);
      CHECK_MESSAGE(files.contains(name), name);
    }
    CHECK(!fs::exists(out.path / "model.safetensors"));
    const auto where = check_consolidated(out.path, sink, 2, {files.begin(), files.end()});
    CHECK(where.size() == index["weight_map"].size());
    for (const auto& [name, file] : where) CHECK(index["weight_map"][name] == file);
    st::any_sink shards = st::make_sink<st::posix_sink>(out.path, st::posix_sink_options{.create_root = false});
    for (const auto& key : files) {
      const auto table = ck::read_header(shards, key);
      const std::uint64_t data = table.file_size - table.data_start();
      CHECK_MESSAGE((data <= max || table.tensors.size() == 1), key, " holds ", data, " bytes in ", table.tensors.size(), " tensors");
    }
  }
}

TEST_CASE("[ckpt] shardkit-ckpt on a checkpointer's prefix: the location is the directory that holds step-*") {
  temp_dir dir("prefix");
  {
    st::any_sink sink = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.fsync = false});
    auto groups = sk::comm::make_loopback_world(world);
    sk::test::run_threads(world, [&](int r) {
      ck::checkpointer saver(groups[std::size_t(r)], sink, {.prefix = "runs/7/", .keep_last = 0});
      rank_state s(r, 4);
      REQUIRE(saver.save(4, s.dict).get().committed);
    });
  }
  const std::string loc = (dir.path / "runs" / "7").string();
  auto r = run_tool("ls " + loc);
  CHECK(r.status == 0);
  CHECK(line_with(r.output, "complete").find("latest") != std::string::npos);
  r = run_tool("verify " + loc);
  CHECK(r.status == 0);
  CHECK(r.output.find("FAIL") == std::string::npos);
  r = run_tool("consolidate " + loc + " --out " + (dir.path / "hf").string());
  CHECK(r.status == 0);
  CHECK(fs::exists(dir.path / "hf" / "model.safetensors"));
}

TEST_CASE("[ckpt] shardkit-ckpt consolidate refuses an --out inside the checkpoint location") {
  temp_dir dir("inside");
  write_checkpoints(dir.path);
  const std::string loc = dir.path.string();
  for (const std::string& out : {loc, loc + "/hf", loc + "/./step-000000000002/x", loc + "/a/../hf"}) {
    CAPTURE(out);
    const auto r = run_tool("consolidate " + loc + " --out " + out);
    CHECK(r.status == 2);
    CHECK(r.output.find("inside the checkpoint location") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(dir.path / "hf"));
  const auto r = run_tool("consolidate " + loc + " --out " + loc + "-hf");  // beside it, sharing its name's start
  CHECK(r.status == 0);
  fs::remove_all(loc + "-hf");
}

TEST_CASE("[ckpt] shardkit-ckpt: clear errors for a bad location or bad arguments") {
  temp_dir empty("empty");
  auto r = run_tool("ls " + empty.path.string());
  INFO("shardkit-ckpt said:\n", r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("0 steps, 0 complete checkpoints") != std::string::npos);
  r = run_tool("verify " + empty.path.string());
  CHECK(r.status == 1);
  CHECK(r.output.find(empty.path.string() + " holds no complete checkpoint") != std::string::npos);
  r = run_tool("ls " + (empty.path / "missing").string());
  CHECK(r.status == 1);
  CHECK(r.output.find("missing") != std::string::npos);
  CHECK(!fs::exists(empty.path / "missing"));  // reading never creates the directory
  CHECK(run_tool("consolidate " + empty.path.string()).status == 2);  // no --out
  CHECK(run_tool("consolidate " + empty.path.string() + " --out x --max-shard-size 5XB").status == 2);
  CHECK(run_tool("frobnicate " + empty.path.string()).status == 2);
  CHECK(run_tool("--help").status == 0);
}

TEST_CASE("[ckpt] docs/checkpoint-format.md: its example index is what the library writes, byte for byte") {
  std::ifstream in(SHARDKIT_CKPT_FORMAT_DOC);
  REQUIRE(in);
  const std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto intro = doc.find("byte for byte");
  REQUIRE(intro != std::string::npos);
  const auto begin = doc.find("```text\n", intro) + 8;
  const std::string documented = doc.substr(begin, doc.find("\n```", begin) - begin);

  // Section 3.3's checkpoint, written as the checkpointer writes it.
  auto sink = st::make_sink<st::memory_sink>();
  const std::uint64_t step = 100;
  const std::vector<float> w{0, 0.5f, 1, 1.5f, 2, 2.5f}, b{1, 2, 3};
  const std::vector<std::byte> loader[2] = {std::vector<std::byte>(3, std::byte{7}), std::vector<std::byte>(3, std::byte{9})};
  ck::checkpoint_index index{step, 2, {{"run", "example"}}, {}, {}};
  for (int r = 0; r < 2; ++r) {
    std::vector<ck::tensor_source> sources{ck::tensor_piece("layer.w", sk::dtype::f32, {2, 3}, std::uint64_t(3 * r), std::uint64_t(3 * r + 3),
                                                            std::as_bytes(std::span(w).subspan(std::size_t(3 * r), 3)))};
    if (r == 0) sources.push_back(ck::whole_tensor("layer.b", sk::dtype::f32, {3}, std::as_bytes(std::span(b))));
    sources.push_back(ck::whole_tensor(ck::rank_entry_tensor(r, "loader"), sk::dtype::u8, {3}, loader[r]));
    ck::add_file(index, ck::write_safetensors(sink, ck::rank_file_key("", step, r), sources,
                                              {{"step", std::to_string(step)}, {"rank", std::to_string(r)}, {"world_size", "2"}}));
  }
  CHECK(ck::to_json(index) == documented);
  CHECK(ck::parse_index(documented, "the documented index") == index);

  // Rank 1's file: N = 392 (88 01 ...), 415 bytes, data 1.5 2 2.5 then the loader's 09 09 09.
  const auto file = st::get_object(sink, ck::rank_file_key("", step, 1));
  REQUIRE(file.size() == 415);
  CHECK(std::to_integer<int>(file[0]) == 0x88);
  CHECK(std::to_integer<int>(file[1]) == 0x01);
  const std::vector<std::byte> data(file.end() - 15, file.end());
  const std::vector<std::byte> expected{std::byte{0x00}, std::byte{0x00}, std::byte{0xc0}, std::byte{0x3f}, std::byte{0x00},
                                        std::byte{0x00}, std::byte{0x00}, std::byte{0x40}, std::byte{0x00}, std::byte{0x00},
                                        std::byte{0x20}, std::byte{0x40}, std::byte{0x09}, std::byte{0x09}, std::byte{0x09}};
  CHECK(data == expected);
}

#if defined(SHARDKIT_HAS_S3)
TEST_CASE("[ckpt] shardkit-ckpt over s3://bucket/prefix (the server scripts/test starts)") {
  const char* endpoint = std::getenv("AWS_ENDPOINT_URL");
  const char* bucket = std::getenv("SHARDKIT_TEST_S3_BUCKET");
  if (!endpoint || !*endpoint || !bucket || !*bucket) {
    MESSAGE("[ckpt] the s3:// case skipped: no test S3 server (scripts/test starts s3rver and sets AWS_ENDPOINT_URL)");
    return;
  }
  temp_dir dir("s3");
  write_checkpoints(dir.path);
  const std::string location = std::string("s3://") + bucket + "/ckpt-cli-" + std::to_string(::getpid());
  st::any_sink s3 = st::open_sink(location);
  st::any_sink local = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.create_root = false});
  for (const auto& key : local.list("")) st::put_object(s3, key, st::get_object(local, key));

  auto r = run_tool("ls " + location);
  INFO("shardkit-ckpt said:\n", r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("3 steps, 2 complete checkpoints, latest step 2") != std::string::npos);
  r = run_tool("verify " + location);
  CHECK(r.status == 0);
  CHECK(r.output.find(": OK") != std::string::npos);
  temp_dir out("s3-out");
  r = run_tool("consolidate " + location + " --out " + out.path.string() + " --step 1");
  REQUIRE(r.status == 0);
  check_consolidated(out.path, local, 1, {"model.safetensors"});

  // Pending multipart uploads as killed writers leave them: one part sent, never completed nor aborted. In a
  // complete step, and in the step newer than the latest (perhaps a live save).
  auto s3_sink_of = std::make_shared<st::s3_sink>(location);
  auto leave_upload = [&](std::uint64_t step, std::size_t bytes) {
    st::detail::s3::client c(st::parse_s3_location(location), st::s3_options::from_env());
    const std::string key = c.full_key(ck::rank_file_key("", step, 7));
    auto created = c.execute({.operation = "CreateMultipartUpload", .method = "POST", .key = key, .query = "uploads="});
    const std::string id = st::detail::s3::xml_value(created.text, "UploadId");
    REQUIRE(created.ok());
    const std::vector<std::byte> part(bytes, std::byte{1});
    REQUIRE(c.execute({.operation = "UploadPart", .method = "PUT", .key = key,
                       .query = "partNumber=1&uploadId=" + st::detail::s3::uri_encode(id, false), .body = part}).ok());
  };
  leave_upload(1, 3000);
  leave_upload(3, 40);
  r = run_tool("ls " + location);
  CHECK(r.output.find("2 pending multipart uploads (2.97 KiB) that killed writers left") != std::string::npos);
  // Step 1's goes (an older step: no save writes there); step 3's is younger than --min-age and stays.
  r = run_tool("gc " + location);
  CHECK(r.output.find("1 pending multipart upload (2.93 KiB)") != std::string::npos);
  REQUIRE(s3_sink_of->pending_uploads().size() == 1);
  CHECK(s3_sink_of->pending_uploads()[0].key == ck::rank_file_key("", 3, 7));
  {
    // A live run holds the prefix: its upload is its save in progress; gc --min-age 0 is refused, naming it.
    ck::location_lease lease(s3, "", location, "live-run", std::chrono::seconds(120));
    lease.acquire();
    r = run_tool("ls " + location);
    CHECK(r.output.find("in progress: run live-run holds the lease (host ") != std::string::npos);
    CHECK(r.output.find("its save in progress: 1 object (31 B) of steps without an index yet, 1 pending multipart upload (40 B)") !=
          std::string::npos);
    r = run_tool("gc " + location + " --min-age 0");
    CHECK(r.status == 1);
    CHECK(r.output.find(location + " is in use: run live-run holds the lease (host ") != std::string::npos);
    CHECK(s3_sink_of->pending_uploads().size() == 1);
  }
  r = run_tool("gc " + location + " --min-age 0");
  CHECK(r.output.find("1 pending multipart upload (40 B)") != std::string::npos);
  CHECK(s3_sink_of->pending_uploads().empty());
  for (const auto& key : s3.list("")) s3.remove(key);
}
#endif
