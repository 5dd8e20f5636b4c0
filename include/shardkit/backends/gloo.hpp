#pragma once
//! gloo_communicator: shardkit's communicator concept over Gloo (facebookincubator/gloo), CPU tensors over TCP.
//!
//! @code
//! auto store = shardkit::rendezvous::connect_store(shardkit::rendezvous::info_from_env());
//! auto comm = shardkit::backends::gloo_communicator::create(store, rank, world_size);
//! auto pg = shardkit::comm::process_group::create(std::move(comm));
//! @endcode
//!
//! What runs where:
//! | operation                          | implementation                                                          |
//! |------------------------------------|-------------------------------------------------------------------------|
//! | all_reduce (sum, min, max, prod)   | gloo::allreduce (ring; every dtype through shardkit's reduce loops)      |
//! | all_reduce avg                     | gloo::allreduce sum, then one division (gloo has no average)             |
//! | all_reduce algo=recursive_doubling | shardkit's recursive doubling over gloo's pairs (gloo_p2p)               |
//! | reduce                             | gloo::reduce (+ division for avg; non-roots reduce into scratch)         |
//! | reduce_scatter                     | shardkit's ring reduce-scatter over gloo_p2p (this gloo has no function) |
//! | all_gather(v), broadcast           | gloo::allgather(v), gloo::broadcast (in place natively)                  |
//! | all_to_all(v)                      | gloo::alltoall(v) (in place through a copy of the input)                 |
//! | barrier                            | gloo::barrier                                                           |
//! | send/recv, isend/irecv             | gloo_p2p (unbound buffers, size header, user tag range)                  |
//! | split/dup                          | all-gather of (color, key), then a new gloo context per color            |
//!
//! Deadlines: each gloo call gets the time left until the op's deadline. A failure closes the group's
//! connections (the group is broken, as after any failed collective) and is reported after a short exchange of
//! failure records through the store, so a timeout names the rank that never arrived (detail::gloo::diagnose).
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <sstream>
#include <tuple>
#include <vector>

#include "shardkit/backends/gloo/detail/diagnosis.hpp"
#include "shardkit/backends/gloo/detail/group.hpp"
#include "shardkit/backends/gloo/detail/p2p.hpp"
#include "shardkit/backends/gloo/options.hpp"
#include "shardkit/comm/algorithms/recursive_doubling.hpp"
#include "shardkit/comm/detail/checked_recv.hpp"
#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/comm/detail/p2p_stall.hpp"
#include "shardkit/comm/algorithms/ring.hpp"
#include "shardkit/comm/communicator.hpp"

namespace shardkit::backends {

class gloo_communicator {
  using kind = comm::detail::collective_kind;
  //! What every rank must agree on before gloo moves a byte (see gloo_options::verify).
  using record = comm::detail::op_fingerprint;

 public:
  using communicator_concept = comm::communicator_tag;
  using options = gloo_options;

  //! Rendezvous of `size` ranks through `store` (every rank calls it with its own rank); blocks until the full
  //! mesh is connected or opts.connect_timeout passes.
  static gloo_communicator create(rendezvous::any_store store, int rank, int size, gloo_options opts = gloo_options::from_env()) {
    return gloo_communicator(detail::gloo::connect_world(std::move(store), rank, size, std::move(opts)));
  }

  int rank() const noexcept { return g_->rank(); }
  int size() const noexcept { return g_->size(); }
  bool supports(device d) const noexcept { return d.kind == device_kind::host; }
  //! The underlying gloo context (to run other gloo algorithms on this group's connections).
  const std::shared_ptr<::gloo::rendezvous::Context>& context() const noexcept { return g_->context; }

  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    run("all_reduce", o, record{kind::all_reduce, out.type(), out.count(), -1, op}, [&](std::uint32_t tag) {
      if (out.count() == 0) return;
      if (o.algo == comm::algorithm::recursive_doubling && size() > 1) {
        if (in.data() != out.data()) std::memmove(out.data(), in.data(), out.size_bytes());
        auto ctx = p2p_op("all_reduce", tag, o);
        comm::algorithms::recursive_doubling_all_reduce(ctx, out.data(), out.count(), out.type(), op);
        return;
      }
      typed(out.type(), [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        ::gloo::AllreduceOptions g(g_->context);
        if (in.data() != out.data()) g.setInput(const_cast<T*>(reinterpret_cast<const T*>(in.data())), in.count());
        g.setOutput(reinterpret_cast<T*>(out.data()), out.count());
        g.setReduceFunction(reduce_function(op, out.type()));
        g.setTag(tag);
        g.setTimeout(time_left(o));
        if (o.algo == comm::algorithm::ring) g.setAlgorithm(::gloo::AllreduceOptions::Algorithm::RING);
        ::gloo::allreduce(g);
      });
      finish_average(op, out.type(), out.data(), out.count(), size());
    });
  }

  void all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    run("all_gather", o, record{kind::all_gather, in.type(), in.count()}, [&](std::uint32_t tag) {
      if (in.count() == 0) return;
      typed(in.type(), [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        ::gloo::AllgatherOptions g(g_->context);
        if (in.data() != out.data() + in.size_bytes() * std::size_t(rank()))
          g.setInput(const_cast<T*>(reinterpret_cast<const T*>(in.data())), in.count());
        g.setOutput(reinterpret_cast<T*>(out.data()), out.count());
        g.setTag(tag);
        g.setTimeout(time_left(o));
        ::gloo::allgather(g);
      });
    });
  }

  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> counts, const comm::collective_options& o) {
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    run("all_gatherv", o, record{kind::all_gatherv, in.type(), total, -1, reduce_op::sum, comm::detail::counts_fingerprint(counts)}, [&](std::uint32_t tag) {
      if (total == 0) return;
      const std::size_t before = std::accumulate(counts.begin(), counts.begin() + rank(), std::size_t{0});
      typed(in.type(), [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        ::gloo::AllgathervOptions g(g_->context);
        if (in.data() != out.data() + before * in.element_size())
          g.setInput(const_cast<T*>(reinterpret_cast<const T*>(nonnull(in.data()))), in.count());
        g.setOutput(reinterpret_cast<T*>(out.data()), std::vector<std::size_t>(counts.begin(), counts.end()));
        g.setTag(tag);
        g.setTimeout(time_left(o));
        ::gloo::allgatherv(g);
      });
    });
  }

  //! gloo (this version) has no reduce-scatter function: shardkit's pipelined ring runs over gloo's pairs.
  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    run("reduce_scatter", o, record{kind::reduce_scatter, out.type(), out.count(), -1, op}, [&](std::uint32_t tag) {
      auto ctx = p2p_op("reduce_scatter", tag, o);
      std::vector<std::size_t> counts(std::size_t(size()), out.count());
      comm::algorithms::ring_reduce_scatter(ctx, in.data(), out.data(), comm::algorithms::partition::from_counts(counts),
                                            out.type(), op, segment_elems(out.type()));
      finish_average(op, out.type(), out.data(), out.count(), size());
    });
  }

  void broadcast(buffer_view data, int root, const comm::collective_options& o) {
    run("broadcast", o, record{kind::broadcast, data.type(), data.count(), root}, [&](std::uint32_t tag) {
      if (data.count() == 0 || size() == 1) return;
      typed(data.type(), [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        ::gloo::BroadcastOptions g(g_->context);
        g.setOutput(reinterpret_cast<T*>(data.data()), data.count());
        g.setRoot(root);
        g.setTag(tag);
        g.setTimeout(time_left(o));
        ::gloo::broadcast(g);
      });
    });
  }

  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const comm::collective_options& o) {
    run("reduce", o, record{kind::reduce, in.type(), in.count(), root, op}, [&](std::uint32_t tag) {
      if (in.count() == 0) return;
      std::vector<std::byte> scratch;  // gloo reduces into a full-size output on every rank
      std::byte* dst = out.data();
      if (rank() != root) {
        scratch.resize(in.size_bytes());
        dst = scratch.data();
      }
      typed(in.type(), [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        ::gloo::ReduceOptions g(g_->context);
        if (in.data() != dst) g.setInput(const_cast<T*>(reinterpret_cast<const T*>(in.data())), in.count());
        g.setOutput(reinterpret_cast<T*>(dst), in.count());
        g.setRoot(root);
        g.setReduceFunction(reduce_function(op, in.type()));
        g.setTag(tag);
        g.setTimeout(time_left(o));
        ::gloo::reduce(g);
      });
      if (rank() == root) finish_average(op, in.type(), out.data(), in.count(), size());
    });
  }

  void all_to_all(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    run("all_to_all", o, record{kind::all_to_all, in.type(), in.count()}, [&](std::uint32_t tag) {
      if (in.count() == 0) return;
      std::vector<std::byte> copy;
      const auto src = detached_input(in, out, copy);
      if (size() == 1) {
        if (src.data() != out.data()) std::memmove(out.data(), src.data(), in.size_bytes());
        return;
      }
      typed(in.type(), [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        ::gloo::AlltoallOptions g(g_->context);
        g.setInput(const_cast<T*>(reinterpret_cast<const T*>(src.data())), in.count());
        g.setOutput(reinterpret_cast<T*>(out.data()), out.count());
        g.setTag(tag);
        g.setTimeout(time_left(o));
        ::gloo::alltoall(g);
      });
    });
  }

  void all_to_allv(const_buffer_view in, std::span<const std::size_t> in_counts, buffer_view out,
                   std::span<const std::size_t> out_counts, const comm::collective_options& o) {
    run("all_to_allv", o, record{kind::all_to_allv, in.type(), std::size_t(size())}, [&](std::uint32_t tag) {
      if (verify_enabled()) verify_matrix(in_counts, out_counts, tag, o);
      std::vector<std::byte> copy;
      const auto src = detached_input(in, out, copy);
      if (size() == 1) {
        if (in.size_bytes() && src.data() != out.data()) std::memmove(out.data(), src.data(), in.size_bytes());
        return;
      }
      typed(in.type(), [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        ::gloo::AlltoallvOptions g(g_->context);
        g.setInput(const_cast<T*>(reinterpret_cast<const T*>(nonnull(src.data()))), std::vector<std::int64_t>(in_counts.begin(), in_counts.end()));
        g.setOutput(reinterpret_cast<T*>(nonnull(out.data())), std::vector<std::int64_t>(out_counts.begin(), out_counts.end()));
        g.setTag(tag);
        g.setTimeout(time_left(o));
        ::gloo::alltoallv(g);
      });
    });
  }

  void barrier(const comm::collective_options& o) {
    run("barrier", o, std::nullopt, [&](std::uint32_t tag) {
      if (size() == 1) return;
      ::gloo::BarrierOptions g(g_->context);
      g.setTag(tag);
      g.setTimeout(time_left(o));
      ::gloo::barrier(g);
    });
  }

  //! Point-to-point in the user tag range (bit 55 of the adapter's tag), never matching collective traffic.
  completion isend(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options&) {
    check_user_tag(tag, "send");
    if (auto b = broken_completion()) return *b;
    return g_->p2p->send(peer, user_tag(tag), in.bytes());
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options&) {
    check_user_tag(tag, "recv");
    if (auto b = broken_completion()) return *b;
    return comm::detail::checked_recv(g_->p2p->recv(peer, user_tag(tag), out.bytes()), out.size_bytes(),
                                      {.rank = rank(), .peer = peer, .operation = "recv"},
                                      [](std::exception_ptr e, const error_context& ctx) {
                                        return std::make_exception_ptr(detail::gloo::from_gloo_exception(e, ctx));
                                      });
  }
  void send(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) {
    wait_p2p(isend(in, peer, tag, o), {.me = rank(), .peer = peer, .tag = tag, .bytes = in.size_bytes(), .sending = true}, o);
  }
  void recv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) {
    wait_p2p(irecv(out, peer, tag, o), {.me = rank(), .peer = peer, .tag = tag, .bytes = out.size_bytes(), .sending = false}, o);
  }

  //! Collective: ranks of one color get a new gloo context (fresh connections) under a store prefix derived
  //! from this group's prefix, the leader's rank and the leader's split counter, so no two splits share keys.
  std::optional<gloo_communicator> split(int color, int key, const comm::collective_options& o) {
    const std::uint32_t offered = g_->next_split.load();
    std::int64_t mine[3] = {color, key, std::int64_t(offered)};
    std::vector<std::int64_t> all(std::size_t(size()) * 3);
    all_gather(const_buffer_view(mine, 3, dtype::i64), buffer_view(all.data(), all.size(), dtype::i64), o);
    if (color < 0) return std::nullopt;
    std::vector<std::tuple<std::int64_t, int>> chosen;  // (key, rank)
    for (int r = 0; r < size(); ++r)
      if (all[std::size_t(r) * 3] == color) chosen.emplace_back(all[std::size_t(r) * 3 + 1], r);
    std::sort(chosen.begin(), chosen.end());
    const int leader = std::get<1>(chosen.front());
    if (leader == rank()) g_->next_split.fetch_add(1);
    int child_rank = 0;
    for (std::size_t i = 0; i < chosen.size(); ++i)
      if (std::get<1>(chosen[i]) == rank()) child_rank = int(i);
    const std::string prefix = g_->prefix + "/split" + std::to_string(leader) + "." + std::to_string(all[std::size_t(leader) * 3 + 2]);
    auto timeout = g_->world->opts.connect_timeout;
    if (o.until != no_deadline)
      timeout = std::min(timeout, ms_left_until(o.until));
    return gloo_communicator(detail::gloo::connect_group(g_->world, prefix, child_rank, int(chosen.size()), timeout));
  }

 private:
  explicit gloo_communicator(std::shared_ptr<detail::gloo::group_state> g) : g_(std::move(g)) {}

  template <class F>
  static void typed(dtype t, F&& f) {
    visit_dtype(t, [&](auto tag) { f(static_cast<decltype(tag)*>(nullptr)); });
  }
  static const std::byte* nonnull(const std::byte* p) noexcept {  // gloo wants a pointer even for 0 bytes
    static std::byte dummy;
    return p ? p : &dummy;
  }
  static std::byte* nonnull(std::byte* p) noexcept { return const_cast<std::byte*>(nonnull(static_cast<const std::byte*>(p))); }

  //! gloo's reduce callback: out = a (op) b, where out may be a (or b).
  static ::gloo::AllreduceOptions::Func reduce_function(reduce_op op, dtype t) {
    return [op, t](void* out, const void* a, const void* b, std::size_t n) {
      if (out == a) combine(op, t, out, b, n);
      else if (out == b) combine(op, t, out, a, n);
      else {
        std::memcpy(out, a, n * size_of(t));
        combine(op, t, out, b, n);
      }
    };
  }

  std::chrono::milliseconds time_left(const comm::collective_options& o) const {
    if (o.until == no_deadline) return detail::gloo::wait_forever;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(o.until - steady_clock::now());
    if (left.count() <= 0) throw error(errc::timeout, "the deadline passed before gloo started", {.rank = rank()});
    return left;
  }
  bool verify_enabled() const noexcept { return g_->world->opts.verify && size() > 1; }
  std::size_t segment_elems(dtype t) const noexcept { return std::max<std::size_t>(1, g_->world->opts.segment_bytes / size_of(t)); }

  comm::algorithms::p2p_op<detail::gloo::gloo_p2p> p2p_op(const char* name, std::uint32_t tag, const comm::collective_options& o) {
    return comm::algorithms::p2p_op<detail::gloo::gloo_p2p>(*g_->p2p, g_->members, rank(), transport::message_tag(tag),
                                                           o.until, name);
  }
  static transport::message_tag user_tag(std::uint32_t tag) noexcept { return (transport::message_tag(1) << 55) | tag; }
  void check_user_tag(std::uint32_t tag, const char* op) const {
    if (tag >= (1u << 31)) throw error(errc::invalid_argument, "user tags must be below 2^31", {.rank = rank(), .operation = op});
  }
  std::optional<completion> broken_completion() const {
    std::lock_guard lock(g_->mutex);
    if (g_->broken) return completion::failed(g_->broken);
    return std::nullopt;
  }
  //! A wait that lasts writes the stall line, as process_group's send and recv do (gloo cannot tell a stopped
  //! peer's process: the line says the peer is slow, stuck, stopped or has not called its part).
  void wait_p2p(const completion& c, const comm::detail::p2p_transfer& t, const comm::collective_options& o) {
    if (!comm::detail::wait_logging_stalls(c, t, o.until, o.stall_log, o.group, size(), [](int) { return std::string(); })) {
      c.cancel();
      throw error(errc::timeout, std::string("deadline passed before the message was ") + (t.sending ? "taken" : "delivered"),
                  {.rank = rank(), .peer = t.peer, .operation = t.sending ? "send" : "recv"});
    }
  }

  //! In-place all-to-all: gloo sends from its input while writing its output, so the input is copied first.
  static std::span<const std::byte> detached_input(const_buffer_view in, buffer_view out, std::vector<std::byte>& copy) {
    if (!overlaps(in, out)) return in.bytes();
    copy.assign(in.data(), in.data() + in.size_bytes());
    return copy;
  }

  //! A disagreement found before gloo moved a byte: nothing is pending, every rank throws the same.
  struct verify_mismatch : error {
    using error::error;
  };

  //! Runs one collective: checks that the ranks agree, then `body(tag)`; a failure breaks the group.
  template <class F>
  void run(const char* name, const comm::collective_options& o, std::optional<record> rec, F&& body) {
    g_->throw_if_broken();
    const std::uint32_t seq = g_->seq++;
    const std::uint32_t tag = seq * 2 + 1;  // even tags are the verification exchanges
    try {
      if (rec && verify_enabled()) verify(name, seq, o.fingerprint(*rec), o);
      body(tag);
    } catch (const verify_mismatch& e) {
      const error plain(e.code(), e.detail(), e.context());
      g_->mark_broken(std::make_exception_ptr(plain));
      throw plain;
    } catch (const error& e) {
      if (e.code() == errc::invalid_argument || e.code() == errc::unsupported) throw;
      fail(name, seq, std::current_exception());
    } catch (...) {
      fail(name, seq, std::current_exception());
    }
  }

  [[noreturn]] void fail(const char* name, std::uint32_t seq, std::exception_ptr cause) {
    const error own = detail::gloo::from_gloo_exception(cause, {.rank = rank(), .operation = name});
    g_->shut_down(std::make_exception_ptr(own));
    const error reported = detail::gloo::diagnose_failure(g_->store, rank(), size(), seq, name, own, g_->world->opts.diagnosis_window);
    g_->mark_broken(std::make_exception_ptr(reported));
    throw reported;
  }

  //! A fixed-size all-gather of every rank's record: safe whatever the ranks called, and all ranks see the same
  //! table, so they all fail with the same errc::mismatch.
  void verify(const char* name, std::uint32_t seq, const record& r, const comm::collective_options& o) {
    auto mine = r.encode();
    std::vector<std::int64_t> all(record::width * std::size_t(size()));
    ::gloo::AllgatherOptions g(g_->context);
    g.setInput(mine.data(), mine.size());
    g.setOutput(all.data(), all.size());
    g.setTag(seq * 2);
    g.setTimeout(time_left(o));
    ::gloo::allgather(g);
    try {
      comm::detail::check_fingerprints(all, size(), name, {.rank = rank(), .operation = name}, seq);
    } catch (const error& e) {
      throw verify_mismatch(e.code(), e.detail(), e.context());
    }
  }

  //! all_to_allv: what rank i sends to j must be what j expects from i, checked on every rank.
  void verify_matrix(std::span<const std::size_t> in_counts, std::span<const std::size_t> out_counts, std::uint32_t tag,
                     const comm::collective_options& o) {
    const std::size_t n = std::size_t(size());
    std::vector<std::int64_t> mine(2 * n), all(2 * n * n);
    for (std::size_t j = 0; j < n; ++j) {
      mine[j] = std::int64_t(in_counts[j]);
      mine[n + j] = std::int64_t(out_counts[j]);
    }
    ::gloo::AllgatherOptions g(g_->context);
    g.setInput(mine.data(), mine.size());
    g.setOutput(all.data(), all.size());
    g.setTag(tag);
    g.setTimeout(time_left(o));
    ::gloo::allgather(g);  // tag reused by alltoallv below: different slot prefix
    try {
      comm::detail::check_count_matrix(all, n, {.rank = rank(), .operation = "all_to_allv"});
    } catch (const error& e) {
      throw verify_mismatch(e.code(), e.detail(), e.context());
    }
  }

  std::shared_ptr<detail::gloo::group_state> g_;
};

static_assert(comm::communicator<gloo_communicator>);

}  // namespace shardkit::backends
