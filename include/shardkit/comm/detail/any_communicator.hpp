#pragma once
//! Type erasure for communicators, so process_group (and FSDP, the checkpointer, the loader above it) is one
//! concrete type whatever backend runs underneath. User-facing types model the concept; only this erasure is
//! virtual.
#include <condition_variable>
#include <cstdlib>
#include <cxxabi.h>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <typeinfo>
#include <variant>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/shared_settings.hpp"
#include "shardkit/core/detail/blocking_call_pool.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm::detail {

//! T's name as the source spells it (shardkit::comm::p2p_communicator<shardkit::transport::shm_transport>), for
//! messages that name a group's backend: the concept has no name member, and every type has this one.
template <class T>
std::string type_name() {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> readable(abi::__cxa_demangle(typeid(T).name(), nullptr, nullptr, &status),
                                                   std::free);
  return status == 0 && readable ? std::string(readable.get()) : std::string(typeid(T).name());
}

struct communicator_interface {
  virtual ~communicator_interface() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual bool supports(device) const = 0;
  virtual void all_reduce(const_buffer_view, buffer_view, reduce_op, const collective_options&) = 0;
  virtual void all_gather(const_buffer_view, buffer_view, const collective_options&) = 0;
  virtual void all_gatherv(const_buffer_view, buffer_view, std::span<const std::size_t>, const collective_options&) = 0;
  virtual void reduce_scatter(const_buffer_view, buffer_view, reduce_op, const collective_options&) = 0;
  virtual void broadcast(buffer_view, int, const collective_options&) = 0;
  virtual void reduce(const_buffer_view, buffer_view, reduce_op, int, const collective_options&) = 0;
  virtual void all_to_all(const_buffer_view, buffer_view, const collective_options&) = 0;
  virtual void all_to_allv(const_buffer_view, std::span<const std::size_t>, buffer_view, std::span<const std::size_t>,
                           const collective_options&) = 0;
  virtual void barrier(const collective_options&) = 0;
  //! all_gather of a few bytes of host memory (process_group's fingerprints), on backends whose collectives
  //! take only device memory too: the communicator's host_all_gather where it has one, else its all_gather.
  virtual void host_all_gather(const_buffer_view, buffer_view, const collective_options&) = 0;
  //! Point-to-point returns a completion at once; backends without native async p2p run it on blocking_p2p_runner.
  virtual completion isend(const_buffer_view, int, std::uint32_t, const collective_options&) = 0;
  virtual completion irecv(buffer_view, int, std::uint32_t, const collective_options&) = 0;
  virtual std::unique_ptr<communicator_interface> split(int, int, const collective_options&) = 0;
  //! Fails what is in flight underneath (the transport, the NCCL communicator), so that no buffer of an
  //! abandoned operation is touched afterwards. False when the backend cannot abort.
  virtual bool abort(std::exception_ptr reason) = 0;
  //! Fails the group on every member at once: their pending and later collectives throw `code` naming `what`
  //! (p2p_communicator::fail_everywhere). False where the backend cannot tell its peers.
  virtual bool fail_everywhere(errc code, const std::string& what) = 0;
  //! The communicator's scratch_bytes() where it has one; nullopt where it cannot tell.
  virtual std::optional<std::size_t> scratch_bytes() const = 0;
  //! The communicator's type, for messages that name the backend.
  virtual std::string backend_name() const = 0;
  //! Its settings whose effect depends on a group's size (p2p_communicator's options), which a split compares
  //! among the new group's members; nullopt for backends that pick their algorithms themselves.
  virtual std::optional<size_dependent_settings> size_dependent() const = 0;
  //! What the backend sees of group rank r's process (a stopped one), for the stall line (detail/stall_line.hpp);
  //! "" where nothing is worth saying or it cannot tell.
  virtual std::string peer_state(int r) const = 0;
  //! The tags of group rank r's sends to this rank that wait here for a recv, for a recv's timeout; empty where
  //! none do or the backend cannot tell.
  virtual std::vector<std::uint32_t> unmatched_user_tags(int r) const = 0;
};

//! Runs the blocking send/recv of a communicator without isend/irecv, each on a thread of a blocking_call_pool
//! (a blocking send may wait for the peer's matching recv, posted after it: no call waits for another's thread),
//! and turns its outcome into a completion. Threads stay bounded by the most calls ever in flight at once, and the
//! destructor joins them, instead of one new (detached, never joined) thread per call.
class blocking_p2p_runner {
 public:
  //! `f` runs the blocking call; its outcome completes the returned completion.
  template <class F>
  completion run(F f) {
    struct outcome {
      completion_source done;
      std::exception_ptr failure;
    };
    auto o = std::make_shared<outcome>();
    completion c = o->done;
    pool_.run(
        [f = std::move(f), o]() mutable {
          try {
            f();
          } catch (...) {
            o->failure = std::current_exception();
          }
        },
        [o] {
          if (o->failure) o->done.set_error(std::move(o->failure));
          else o->done.set_done();
        });
    return c;
  }

 private:
  shardkit::detail::blocking_call_pool pool_;
};

//! A communicator may offer asynchronous point-to-point natively.
template <class C>
concept has_async_p2p = requires(C& c, const_buffer_view in, buffer_view out, int peer, std::uint32_t tag,
                                 const collective_options& o) {
  { c.isend(in, peer, tag, o) } -> std::same_as<completion>;
  { c.irecv(out, peer, tag, o) } -> std::same_as<completion>;
};

template <communicator C>
class communicator_model final : public communicator_interface {
 public:
  explicit communicator_model(C c) : comm_(std::move(c)) {}
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  bool supports(device d) const override { return comm_.supports(d); }
  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) override {
    comm_.all_reduce(in, out, op, o);
  }
  void all_gather(const_buffer_view in, buffer_view out, const collective_options& o) override { comm_.all_gather(in, out, o); }
  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> c, const collective_options& o) override {
    comm_.all_gatherv(in, out, c, o);
  }
  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) override {
    comm_.reduce_scatter(in, out, op, o);
  }
  void broadcast(buffer_view d, int root, const collective_options& o) override { comm_.broadcast(d, root, o); }
  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const collective_options& o) override {
    comm_.reduce(in, out, op, root, o);
  }
  void all_to_all(const_buffer_view in, buffer_view out, const collective_options& o) override { comm_.all_to_all(in, out, o); }
  void all_to_allv(const_buffer_view in, std::span<const std::size_t> ic, buffer_view out, std::span<const std::size_t> oc,
                   const collective_options& o) override {
    comm_.all_to_allv(in, ic, out, oc, o);
  }
  void barrier(const collective_options& o) override { comm_.barrier(o); }
  void host_all_gather(const_buffer_view in, buffer_view out, const collective_options& o) override {
    if constexpr (has_host_all_gather<C>) {
      comm_.host_all_gather(in, out, o);
    } else {
      // Every rank of a group runs the same backend, so every rank refuses here alike, before anything is sent.
      if (!comm_.supports(device::host()))
        throw error(errc::unsupported, "this backend's collectives take no host memory and it has no host_all_gather, so "
                                       "process_group cannot exchange its host metadata (check_consistency fingerprints)");
      comm_.all_gather(in, out, o);
    }
  }
  completion isend(const_buffer_view in, int peer, std::uint32_t tag, const collective_options& o) override {
    if constexpr (has_async_p2p<C>) return comm_.isend(in, peer, tag, o);
    else return blocking_p2p_.run([=, this] { comm_.send(in, peer, tag, o); });
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, const collective_options& o) override {
    if constexpr (has_async_p2p<C>) return comm_.irecv(out, peer, tag, o);
    else return blocking_p2p_.run([=, this] { comm_.recv(out, peer, tag, o); });
  }
  std::unique_ptr<communicator_interface> split(int color, int key, const collective_options& o) override {
    auto child = comm_.split(color, key, o);
    if (!child) return nullptr;
    return std::make_unique<communicator_model>(std::move(*child));
  }
  bool abort(std::exception_ptr reason) override {
    if constexpr (requires { { comm_.abort(reason) } -> std::same_as<bool>; }) {
      return comm_.abort(std::move(reason));  // an adapter over a backend that may not abort (any_communicator)
    } else if constexpr (requires { comm_.abort(reason); }) {
      comm_.abort(std::move(reason));
      return true;
    } else if constexpr (requires { comm_.abort(std::string()); }) {
      std::string why = "aborted";
      try {
        std::rethrow_exception(reason);
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
      }
      comm_.abort(why);
      return true;
    } else {
      return false;
    }
  }
  bool fail_everywhere(errc code, const std::string& what) override {
    if constexpr (requires { { comm_.fail_everywhere(code, what) } -> std::same_as<bool>; })
      return comm_.fail_everywhere(code, what);
    else
      return false;
  }
  std::optional<std::size_t> scratch_bytes() const override {
    if constexpr (has_scratch_bytes<C>)
      return std::size_t(comm_.scratch_bytes());
    else
      return std::nullopt;
  }
  //! The communicator's own backend_name() where it has one (an adapter naming what it wraps), else its type.
  std::string backend_name() const override {
    if constexpr (requires { { comm_.backend_name() } -> std::convertible_to<std::string>; }) return comm_.backend_name();
    else return type_name<C>();
  }
  std::optional<size_dependent_settings> size_dependent() const override {
    if constexpr (requires { { comm_.options() } -> holds_size_dependent_settings; }) return size_dependent_of(comm_.options());
    else return std::nullopt;
  }
  std::string peer_state(int r) const override {
    if constexpr (requires { { comm_.peer_state(r) } -> std::convertible_to<std::string>; }) return comm_.peer_state(r);
    else return {};
  }
  std::vector<std::uint32_t> unmatched_user_tags(int r) const override {
    if constexpr (requires { { comm_.unmatched_user_tags(r) } -> std::same_as<std::vector<std::uint32_t>>; })
      return comm_.unmatched_user_tags(r);
    else return {};
  }
  C& get() noexcept { return comm_; }

 private:
  C comm_;
  // After comm_, so destroyed first: its workers, which call comm_, are joined before comm_ goes.
  [[no_unique_address]] std::conditional_t<has_async_p2p<C>, std::monostate, blocking_p2p_runner> blocking_p2p_;
};

}  // namespace shardkit::comm::detail
