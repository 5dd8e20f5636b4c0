#pragma once
// The machinery of the conformance suite (conformance.hpp): its options, the values it sends and the checks of
// what comes back, and conformance_run, which records every case's outcome (conformance_report.hpp).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/conformance_buffers.hpp"
#include "comm/conformance_report.hpp"
#include "shardkit/comm/process_group.hpp"

namespace shardkit::test {

class conformance_run;

struct conformance_options {
  //! The name the report files and docs/backends.md use: "loopback", "shm", "tcp", "gloo", "fabric:<provider>",
  //! "nccl". Empty: $SHARDKIT_CONFORMANCE_BACKEND, else "unnamed".
  std::string backend;
  //! "threads" or "processes"; empty: "threads" when shared_counter is set, else "processes".
  std::string mode;
  bool large = true;                    // include the >= 8 MiB counts
  //! The dtypes of the typed cases. Every dtype by default; a larger run of a world size whose algorithms a smaller
  //! odd and a power-of-two size already ran with every dtype may take conformance_detail::one_dtype_per_width():
  //! what tells dtypes apart (element width, the reduce loops' arithmetic) is the same code at any world size.
  std::vector<dtype> dtypes{std::begin(all_dtypes), std::end(all_dtypes)};
  std::vector<comm::algorithm> all_reduce_algorithms{comm::algorithm::automatic, comm::algorithm::ring,
                                                      comm::algorithm::recursive_doubling};
  std::atomic<int>* shared_counter = nullptr;  // thread mode only: lets the barrier case observe ordering
  std::chrono::milliseconds error_timeout{3000};  // per-op timeout in the failure cases that expect a prompt error
  //! Per-op timeout of the cross-rank failure cases, where ranks wait for a peer that never sends (counts that
  //! differ, a peer that never arrives): each run of the suite spends about this once at 2 ranks and twice from
  //! 3 on (the ranks that do not border the odd one only time out), so it is short. Any of the errors those cases
  //! accept may come first, so no outcome depends on it.
  std::chrono::milliseconds absent_peer_timeout{1000};
  //! Where the buffers live: host memory by default; a device backend supplies its allocation and copies.
  buffer_factory buffers;
  //! The backend's average multiplies each contribution by 1/n before summing (ncclAvg): floating averages at
  //! world sizes that are not powers of two may differ from sum-then-divide in the last places.
  bool prescaled_average = false;
  //! min and max propagate NaN and order -0 below +0 (shardkit's reduce loops). False: only that every rank ends
  //! with the same bits is checked (a backend with its own device arithmetic).
  bool ieee_min_max = true;
  //! An operation the backend refuses with errc::unsupported fails the test; false records it and goes on.
  bool unsupported_fails = true;
  //! The failure cases across ranks (counts that differ, a peer that never arrives) as a host backend reports
  //! them. A backend that reports them differently turns them off and adds its own. (The fingerprint cases run
  //! on every backend.)
  bool cross_rank_failure_cases = true;
  //! The backend checks calls by default (p2p_communicator's call check): the mismatch cases of
  //! conformance_call_check run, each failing with errc::mismatch before mismatch_timeout.
  bool call_check = false;
  std::chrono::milliseconds mismatch_timeout{4000};
  //! The backend's own cases, run after the shared ones and before the failure cases; they record through
  //! conformance_run::check like the shared cases.
  std::function<void(conformance_run&)> backend_cases;
};

namespace conformance_detail {

//! A wrong value or behaviour found by the suite (not an error of the backend): recorded, and the run goes on.
struct conformance_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const std::string& what) { throw conformance_failure(what); }

//! After a failed collective: the group must say it is broken and refuse further work at once.
inline void expect_broken(comm::process_group& g) {
  if (!g.broken_by()) fail("a failed collective did not mark its group broken");
  bool refused = false;
  try {
    g.barrier().wait();
  } catch (const error&) {
    refused = true;
  }
  if (!refused) fail("a broken group accepted more work");
}

// Values chosen so every op is exact in every dtype (bf16 has 8 significant bits): small integers for
// sum/avg/min/max, powers of two for prod. value() depends on i only through i % value_period(op).
inline double value(reduce_op op, dtype t, int rank, std::size_t i) {
  const bool is_unsigned = t == dtype::u8 || t == dtype::u64;
  switch (op) {
    case reduce_op::prod: return double(1 + ((rank + i) % 2));
    case reduce_op::min:
    case reduce_op::max: return double(int((rank * 3 + i) % 11) - (is_unsigned ? 0 : 5));
    default: return double(int((rank + i) % 5) - (is_unsigned ? 0 : 2));
  }
}

inline std::size_t value_period(reduce_op op) {
  switch (op) {
    case reduce_op::prod: return 2;
    case reduce_op::min:
    case reduce_op::max: return 11;
    default: return 5;
  }
}

// Expected reduction of value(op, t, r, i) over ranks [0, n), computed in T arithmetic like the backends.
inline double expected_uncached(reduce_op op, dtype t, int n, std::size_t i) {
  typed_buffer acc(t, 1), next(t, 1);
  acc.set(0, value(op, t, 0, i));
  for (int r = 1; r < n; ++r) {
    next.set(0, value(op, t, r, i));
    combine(op, t, acc.bytes.data(), next.bytes.data(), 1);
  }
  finish_average(op, t, acc.bytes.data(), 1, n);
  return acc.get(0);
}

// The same, remembered per thread for the (op, dtype, world size) being checked: the checks call it for every
// element, and its two small allocations per call made the element checks most of an ASan run
// (comm_process_test's cross-memory case: 82 s of ASan, 7 s without).
inline double expected(reduce_op op, dtype t, int n, std::size_t i) {
  struct memo {
    reduce_op op{};
    dtype t{};
    int n = -1;
    std::array<double, 11> v{};
    std::array<bool, 11> known{};
  };
  thread_local memo m;
  if (m.n != n || m.op != op || m.t != t) m = memo{op, t, n, {}, {}};
  const std::size_t k = i % value_period(op);
  if (!m.known[k]) {
    m.v[k] = expected_uncached(op, t, n, k);
    m.known[k] = true;
  }
  return m.v[k];
}

inline std::string where(const std::string& what, dtype t, reduce_op op, std::size_t count, int rank) {
  std::ostringstream os;
  os << what << " dtype=" << to_string(t) << " op=" << to_string(op) << " count=" << count << " rank=" << rank;
  return os.str();
}

inline void check_equal(const typed_buffer& got, std::size_t i, double want, const std::string& ctx) {
  const double g = got.get(i);
  if (!(g == want)) {
    std::ostringstream os;
    os << ctx << ": element " << i << " is " << g << ", expected " << want;
    fail(os.str());
  }
}

inline bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// A reduced element: exact, except where a prescaled average may round differently from sum-then-divide.
inline void check_reduced(const typed_buffer& got, std::size_t i, double want, reduce_op op, int n, const std::string& ctx,
                          const conformance_options& o) {
  if (!o.prescaled_average || op != reduce_op::avg || !is_floating(got.type) || power_of_two(n))
    return check_equal(got, i, want, ctx);
  const double eps = got.type == dtype::f64 ? 0x1p-50 : got.type == dtype::f32 ? 0x1p-21 : got.type == dtype::f16 ? 0x1p-8 : 0x1p-5;
  const double g = got.get(i);
  if (!(std::fabs(g - want) <= eps * std::max(1.0, std::fabs(want)) * n)) {
    std::ostringstream os;
    os << ctx << ": element " << i << " is " << g << ", expected " << want << " (within " << eps * n << ")";
    fail(os.str());
  }
}

//! One dtype of each element width, floats and integers, signed and unsigned among them: f32, i64, bf16 (8
//! significant bits), u8.
inline std::vector<dtype> one_dtype_per_width() { return {dtype::f32, dtype::i64, dtype::bf16, dtype::u8}; }

inline std::vector<std::size_t> counts_for(dtype t, bool large) {
  std::vector<std::size_t> c{0, 1, 37};
  // u64 moves the same 8-byte elements as i64 through every path; only its arithmetic differs, which small counts show.
  if (large && t != dtype::u64) c.push_back((8u << 20) / size_of(t) + 3);
  return c;
}

// Checking every element of the 8 MiB cases would dominate the run time on 2 cores: check a stride plus the
// edges of every chunk boundary region.
inline bool should_check(std::size_t i, std::size_t count) {
  return count < 4096 || i < 1024 || i + 1024 >= count || i % 97 == 0;
}

// Visits exactly the i in [0, count) that should_check accepts, in order, without testing every index.
template <class F>
void for_each_checked(std::size_t count, F&& f) {
  for (std::size_t i = 0; i < count;) {
    f(i);
    std::size_t next = i + 1;
    if (!should_check(next, count)) next = std::min((next + 96) / 97 * 97, count - 1024);
    i = next;
  }
}

// Sets b[first + i] = value_at(i) for i in [0, count), where value_at(i) depends on i only through i % period:
// one period is set, the rest copied. Setting every element (a dtype visit and conversion each) was most of the
// suite's CPU time in its 8 MiB cases.
template <class F>
void fill_periodic(typed_buffer& b, std::size_t first, std::size_t count, std::size_t period, F&& value_at) {
  const std::size_t head = std::min(period, count), es = size_of(b.type);
  for (std::size_t i = 0; i < head; ++i) b.set(first + i, value_at(i));
  std::byte* base = b.bytes.data() + first * es;
  for (std::size_t done = head; done < count;) {  // done stays a multiple of period
    const std::size_t n = std::min(done, count - done);
    std::memcpy(base + done * es, base, n * es);
    done += n;
  }
}

inline std::string backend_name(const conformance_options& o) {
  if (!o.backend.empty()) return o.backend;
  const char* env = std::getenv("SHARDKIT_CONFORMANCE_BACKEND");
  return env && *env ? env : "unnamed";
}

inline std::string mode_name(const conformance_options& o) {
  if (!o.mode.empty()) return o.mode;
  return o.shared_counter ? "threads" : "processes";
}

}  // namespace conformance_detail

//! One rank's run of the suite: the group, the options, and the record of every case.
class conformance_run {
 public:
  conformance_run(comm::process_group& pg, const conformance_options& o)
      : pg_(pg), o_(o),
        report_({conformance_detail::backend_name(o), conformance_detail::mode_name(o), o.buffers.name, pg.size(), pg.rank(), o.large}) {}
  conformance_run(const conformance_run&) = delete;
  conformance_run& operator=(const conformance_run&) = delete;
  //! A run that ends by an exception still writes what it recorded, marked as stopped.
  ~conformance_run() {
    if (!finished_) report_.write_if_requested(false);
  }

  comm::process_group& group() const noexcept { return pg_; }
  const conformance_options& options() const noexcept { return o_; }
  const conformance_report& report() const noexcept { return report_; }
  //! A buffer where the options say buffers live.
  test_buffer buffer(dtype t, std::size_t count) const { return test_buffer(o_.buffers, t, count); }

  //! Runs one variant of case `key` and records how it went. Wrong values are recorded and the run goes on;
  //! errors of the backend are recorded and rethrown.
  template <class F>
  void check(const case_key& key, F&& body) {
    try {
      std::forward<F>(body)();
      report_.note(key, case_outcome::passed);
    } catch (const conformance_detail::conformance_failure& e) {
      report_.note(key, case_outcome::failed, e.what());
      if (!first_failure_) first_failure_ = std::current_exception();
    } catch (const error& e) {
      if (e.code() != errc::unsupported) {
        report_.note(key, case_outcome::failed, e.what());
        throw;
      }
      report_.note(key, case_outcome::unsupported, e.what());
      if (o_.unsupported_fails && !first_failure_) first_failure_ = std::current_exception();
    } catch (const std::exception& e) {
      report_.note(key, case_outcome::failed, e.what());
      throw;
    } catch (...) {
      report_.note(key, case_outcome::failed, "an exception that is not a std::exception");
      throw;
    }
  }

  //! A case this run cannot exercise (e.g. point-to-point in a world of one), with the reason.
  void not_applicable(const case_key& key, const std::string& why) { report_.note(key, case_outcome::not_applicable, why); }

  //! Writes the report, then throws the first failure, if any.
  void finish() {
    finished_ = true;
    report_.write_if_requested(true);
    if (first_failure_) std::rethrow_exception(first_failure_);
  }

 private:
  comm::process_group& pg_;
  const conformance_options& o_;
  conformance_report report_;
  std::exception_ptr first_failure_;
  bool finished_ = false;
};

}  // namespace shardkit::test
