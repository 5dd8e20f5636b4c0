#pragma once
//! any_communicator: a communicator whose backend type is erased, itself a model of comm::communicator.
//!
//! What it is for: wrapping a communicator whose type the wrapper does not know, such as the one init_process_group
//! connects for the transport it picks (comm::init_options::wrap). An adapter over communicators (a template over
//! its C, like backends::cuda_staged_communicator) takes an any_communicator as its C, and the result goes into
//! process_group::create as any other communicator; process_group::create(any_communicator) adds no second layer
//! of erasure.
//!
//! @code
//!   comm::init_options o;
//!   o.wrap = [](comm::any_communicator c, const comm::transport_setup&) {
//!     return comm::any_communicator(my_adapter<comm::any_communicator>(std::move(c)));
//!   };
//!   auto world = comm::init_process_group(o);
//! @endcode
//!
//! Each call costs one virtual call more than the backend's own. send and recv are the backend's isend and irecv
//! waited for until the call's deadline (o.until), writing the stall line while they wait (detail/p2p_stall.hpp);
//! the erased backend's scratch_bytes is nullopt where the backend cannot tell, so any_communicator's is too (it is
//! not has_scratch_bytes).
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/any_communicator.hpp"
#include "shardkit/comm/detail/p2p_stall.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm {

class any_communicator {
 public:
  using communicator_concept = communicator_tag;

  //! Erases `c` (any model of communicator; an any_communicator is moved, not wrapped again). The same-type test
  //! comes first and short-circuits: checking communicator<any_communicator> asks whether any_communicator is
  //! move-constructible, which considers this constructor again.
  template <class C>
    requires(!std::same_as<std::remove_cvref_t<C>, any_communicator> && communicator<C>)
  explicit any_communicator(C c) : impl_(std::make_unique<detail::communicator_model<C>>(std::move(c))) {}
  explicit any_communicator(std::unique_ptr<detail::communicator_interface> impl) : impl_(std::move(impl)) {
    if (!impl_) throw_error(errc::invalid_argument, "any_communicator of no communicator");
  }
  any_communicator(any_communicator&&) noexcept = default;
  any_communicator& operator=(any_communicator&&) noexcept = default;

  int rank() const { return impl_->rank(); }
  int size() const { return impl_->size(); }
  bool supports(device d) const { return impl_->supports(d); }
  //! The erased backend's type as messages name it (process_group::backend_name reports it, not this class's name).
  std::string backend_name() const { return impl_->backend_name(); }
  std::optional<std::size_t> scratch_bytes() const { return impl_->scratch_bytes(); }

  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) {
    impl_->all_reduce(in, out, op, o);
  }
  void all_gather(const_buffer_view in, buffer_view out, const collective_options& o) { impl_->all_gather(in, out, o); }
  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> counts, const collective_options& o) {
    impl_->all_gatherv(in, out, counts, o);
  }
  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) {
    impl_->reduce_scatter(in, out, op, o);
  }
  void broadcast(buffer_view data, int root, const collective_options& o) { impl_->broadcast(data, root, o); }
  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const collective_options& o) {
    impl_->reduce(in, out, op, root, o);
  }
  void all_to_all(const_buffer_view in, buffer_view out, const collective_options& o) { impl_->all_to_all(in, out, o); }
  void all_to_allv(const_buffer_view in, std::span<const std::size_t> in_counts, buffer_view out,
                   std::span<const std::size_t> out_counts, const collective_options& o) {
    impl_->all_to_allv(in, in_counts, out, out_counts, o);
  }
  void barrier(const collective_options& o) { impl_->barrier(o); }
  void host_all_gather(const_buffer_view in, buffer_view out, const collective_options& o) {
    impl_->host_all_gather(in, out, o);
  }

  completion isend(const_buffer_view in, int peer, std::uint32_t tag, const collective_options& o) {
    return impl_->isend(in, peer, tag, o);
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, const collective_options& o) {
    return impl_->irecv(out, peer, tag, o);
  }
  void send(const_buffer_view in, int peer, std::uint32_t tag, const collective_options& o) {
    finish(isend(in, peer, tag, o), {.me = rank(), .peer = peer, .tag = tag, .bytes = in.size_bytes(), .sending = true}, o);
  }
  void recv(buffer_view out, int peer, std::uint32_t tag, const collective_options& o) {
    finish(irecv(out, peer, tag, o), {.me = rank(), .peer = peer, .tag = tag, .bytes = out.size_bytes(), .sending = false}, o);
  }

  //! Fails what is in flight underneath; false where the erased backend cannot abort.
  bool abort(std::exception_ptr reason) { return impl_->abort(std::move(reason)); }
  //! Fails the group on every member (p2p_communicator::fail_everywhere); false where the backend cannot.
  bool fail_everywhere(errc code, const std::string& what) { return impl_->fail_everywhere(code, what); }

  std::optional<any_communicator> split(int color, int key, const collective_options& o) {
    auto child = impl_->split(color, key, o);
    if (!child) return std::nullopt;
    return any_communicator(std::move(child));
  }

  //! The erased communicator, for process_group::create (which erases no further).
  std::unique_ptr<detail::communicator_interface> release() && noexcept { return std::move(impl_); }

 private:
  //! A wait that lasts writes the stall line, as process_group's send and recv do (o.stall_log: when). Past the
  //! deadline the transfer is withdrawn and reported as a timeout; one that cannot be withdrawn still uses the
  //! caller's buffer, so it is waited for.
  void finish(const completion& c, const detail::p2p_transfer& t, const collective_options& o) const {
    if (detail::wait_logging_stalls(c, t, o.until, o.stall_log, o.group, size(), [this](int r) { return impl_->peer_state(r); }))
      return;
    const char* op = t.sending ? "send" : "recv";
    if (c.cancel())
      throw error(errc::timeout, std::string(op) + " did not complete by its deadline",
                  {.rank = rank(), .peer = t.peer, .operation = op});
    c.wait();
  }

  std::unique_ptr<detail::communicator_interface> impl_;
};
static_assert(communicator<any_communicator>);

}  // namespace shardkit::comm
