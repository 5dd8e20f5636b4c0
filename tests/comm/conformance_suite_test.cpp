// The conformance suite checked against a communicator that is wrong on purpose: a wrong value must fail the
// test naming the case, a refusal must be recorded as unsupported, and the report must say both.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "comm/conformance.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "support/harness.hpp"

using namespace shardkit;

namespace {

//! Forwards to C, except: all_reduce of f16 with prod gets its first element wrong, and all_gather of bf16 is
//! refused with errc::unsupported.
template <comm::communicator C>
class faulty_communicator {
 public:
  using communicator_concept = comm::communicator_tag;
  explicit faulty_communicator(C inner) : c_(std::move(inner)) {}

  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  bool supports(device d) const { return c_.supports(d); }
  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    c_.all_reduce(in, out, op, o);
    if (out.type() == dtype::f16 && op == reduce_op::prod && out.count() > 0) out.as<float16>()[0] = float16(3.0f);
  }
  void all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    if (in.type() == dtype::bf16) throw error(errc::unsupported, "bf16 all_gather (refused on purpose)");
    c_.all_gather(in, out, o);
  }
  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> counts, const comm::collective_options& o) {
    c_.all_gatherv(in, out, counts, o);
  }
  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    c_.reduce_scatter(in, out, op, o);
  }
  void broadcast(buffer_view d, int root, const comm::collective_options& o) { c_.broadcast(d, root, o); }
  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const comm::collective_options& o) {
    c_.reduce(in, out, op, root, o);
  }
  void all_to_all(const_buffer_view in, buffer_view out, const comm::collective_options& o) { c_.all_to_all(in, out, o); }
  void all_to_allv(const_buffer_view in, std::span<const std::size_t> ic, buffer_view out, std::span<const std::size_t> oc,
                   const comm::collective_options& o) {
    c_.all_to_allv(in, ic, out, oc, o);
  }
  void barrier(const comm::collective_options& o) { c_.barrier(o); }
  void send(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) { c_.send(in, peer, tag, o); }
  void recv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) { c_.recv(out, peer, tag, o); }
  std::optional<faulty_communicator> split(int color, int key, const comm::collective_options& o) {
    auto child = c_.split(color, key, o);
    if (!child) return std::nullopt;
    return faulty_communicator(std::move(*child));
  }

 private:
  C c_;
};

using loopback_communicator = comm::p2p_communicator<transport::loopback_transport>;

std::vector<comm::process_group> faulty_world(int n) {
  comm::group_options g;
  g.timeout = std::chrono::seconds(60);
  std::vector<comm::process_group> groups;
  for (auto& t : transport::loopback_transport::create_world(n))
    groups.push_back(comm::process_group::create(faulty_communicator<loopback_communicator>(loopback_communicator(t)), g));
  return groups;
}

struct rank_findings {
  std::string thrown;  // what finish() threw, empty if nothing
  std::optional<test::conformance_report::case_record> wrong, refused, fine;
  std::string jsonl;
};

// Runs the all_reduce and gather cases of the suite on n faulty ranks; what each rank recorded and threw.
std::vector<rank_findings> run_faulty(int n, bool unsupported_fails) {
  auto groups = faulty_world(n);
  std::vector<rank_findings> found(static_cast<std::size_t>(n));
  test::conformance_options o;
  o.backend = "faulty-loopback";
  o.mode = "threads";
  o.large = false;
  o.all_reduce_algorithms = {comm::algorithm::automatic};
  o.unsupported_fails = unsupported_fails;
  test::run_threads(n, [&](int r) {
    auto& f = found[std::size_t(r)];
    test::conformance_run run(groups[std::size_t(r)], o);
    test::conformance_all_reduce(run);
    test::conformance_gathers(run);
    const auto copy = [](const test::conformance_report::case_record* c) {
      return c ? std::optional<test::conformance_report::case_record>(*c) : std::nullopt;
    };
    f.wrong = copy(run.report().find({"collective", "all_reduce", dtype::f16, reduce_op::prod}));
    f.refused = copy(run.report().find({"collective", "all_gather", dtype::bf16}));
    f.fine = copy(run.report().find({"collective", "all_reduce", dtype::f16, reduce_op::sum}));
    std::ostringstream os;
    run.report().write_jsonl(os, true);
    f.jsonl = os.str();
    try {
      run.finish();
    } catch (const std::exception& e) {
      f.thrown = e.what();
    }
  });
  return found;
}

// Points $SHARDKIT_CONFORMANCE_REPORT at a fresh directory while alive (never at the one a support-matrix run
// set: these deliberate failures are not a backend's results).
class report_dir {
 public:
  report_dir() : path_(std::filesystem::temp_directory_path() / ("shardkit-conformance-self-test-" + std::to_string(::getpid()))) {
    if (const char* v = std::getenv("SHARDKIT_CONFORMANCE_REPORT")) saved_ = v;
    std::filesystem::remove_all(path_);
    ::setenv("SHARDKIT_CONFORMANCE_REPORT", path_.c_str(), 1);
  }
  ~report_dir() {
    if (saved_) ::setenv("SHARDKIT_CONFORMANCE_REPORT", saved_->c_str(), 1);
    else ::unsetenv("SHARDKIT_CONFORMANCE_REPORT");
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::optional<std::string> saved_;
};

}  // namespace

TEST_CASE("[comm] the conformance suite fails on a wrong value, naming the case, and records every case") {
  report_dir dir;
  const auto found = run_faulty(2, /*unsupported_fails=*/false);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto& f = found[std::size_t(r)];
    CHECK(f.thrown.find("all_reduce") != std::string::npos);
    CHECK(f.thrown.find("dtype=f16 op=prod") != std::string::npos);
    REQUIRE(f.wrong);
    CHECK(f.wrong->result == test::case_outcome::failed);
    CHECK(f.wrong->message == f.thrown);
    REQUIRE(f.refused);
    CHECK(f.refused->result == test::case_outcome::unsupported);
    CHECK(f.refused->message.find("refused on purpose") != std::string::npos);
    REQUIRE(f.fine);
    CHECK(f.fine->result == test::case_outcome::passed);
    CHECK(f.fine->variants == 6);  // counts 0, 1, 37; in place and not
    CHECK(f.jsonl.find(R"("name":"all_gather","dtype":"bf16","op":null,"status":"unsupported")") != std::string::npos);
    // finish() wrote the same records where the environment said.
    std::ifstream in(dir.path() / ("faulty-loopback.threads.n2.r" + std::to_string(r) + ".jsonl"));
    REQUIRE(in.good());
    std::stringstream text;
    text << in.rdbuf();
    CHECK(text.str().find(R"("record":"run","backend":"faulty-loopback","mode":"threads","world_size":2)") == 1);
    CHECK(text.str().find(R"("dtype":"f16","op":"prod","status":"failed")") != std::string::npos);
  }
}

TEST_CASE("[comm] a refusal (errc::unsupported) fails the suite unless the options allow it") {
  report_dir dir;
  // The f16 prod failure comes first, so both runs fail; with unsupported_fails the refusal alone would too.
  const auto strict = run_faulty(2, true);
  CHECK(strict[0].thrown.find("dtype=f16 op=prod") != std::string::npos);
  auto groups = faulty_world(2);
  std::vector<std::string> thrown(2);
  for (bool fails : {true, false}) {
    test::conformance_options o;
    o.backend = "faulty-loopback";
    o.large = false;
    o.unsupported_fails = fails;
    test::run_threads(2, [&](int r) {
      groups[std::size_t(r)].bind_to_this_thread();  // the second run's threads take the groups over
      test::conformance_run run(groups[std::size_t(r)], o);
      test::conformance_gathers(run);
      try {
        run.finish();
      } catch (const error& e) {
        thrown[std::size_t(r)] = e.what();
      }
    });
    for (const auto& t : thrown) CHECK((t.find("refused on purpose") != std::string::npos) == fails);
    thrown.assign(2, "");
  }
}

// The suite fills its buffers one period at a time and visits only the checked elements: the same buffer
// contents, and the same elements checked, as setting and testing every element.
TEST_CASE("[comm] the suite's periodic fill and checked-element walk match the per-element ones") {
  using namespace test::conformance_detail;
  for (std::size_t count : {std::size_t(0), std::size_t(1), std::size_t(37), std::size_t(4095), std::size_t(4096),
                            std::size_t(5000), std::size_t(97 * 97 + 3), std::size_t((8u << 20) / 2 + 3)}) {
    CAPTURE(count);
    std::vector<std::size_t> walked, wanted;
    for_each_checked(count, [&](std::size_t i) { walked.push_back(i); });
    for (std::size_t i = 0; i < count; ++i)
      if (should_check(i, count)) wanted.push_back(i);
    CHECK(walked == wanted);
    for (dtype t : {dtype::bf16, dtype::f64, dtype::u8})
      for (std::size_t period : {std::size_t(2), std::size_t(11), std::size_t(50)}) {
        const auto v = [&](std::size_t i) { return double(i % period); };
        typed_buffer filled(t, count + 9), each(t, count + 9);
        fill_periodic(filled, 9, count, period, v);
        for (std::size_t i = 0; i < count; ++i) each.set(9 + i, v(i));
        CHECK(filled.bytes == each.bytes);
      }
  }
}

// The checks take expected() from a per-thread memo indexed by i % value_period(op): it must give what computing
// the element itself gives, for every op, dtype and world size the suites use, past several periods.
TEST_CASE("[comm] the suite's remembered expected values equal the ones computed per element") {
  using namespace test::conformance_detail;
  for (dtype t : all_dtypes)
    for (reduce_op op : all_reduce_ops)
      for (int n = 1; n <= 8; ++n)
        for (std::size_t i = 0; i < 300; ++i) {
          CAPTURE(i);
          REQUIRE(value(op, t, n - 1, i) == value(op, t, n - 1, i % value_period(op)));
          REQUIRE(expected(op, t, n, i) == expected_uncached(op, t, n, i));
        }
}
