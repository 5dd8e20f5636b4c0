#pragma once
//! Checkpointing tensors that live on a device (a GPU): the checkpoint_device named requirement, and
//! any_checkpoint_device, the erasure checkpointer_options::device holds.
//!
//! A state_dict entry added from a buffer_view on a device (state_dict::add_piece, add_tensor) is never touched by
//! host code: a save queues a device-to-host copy of it into the checkpointer's staging buffer, which the device
//! allocates in the host memory it copies to fastest (page-locked for CUDA: an asynchronous copy at full bus speed,
//! where pageable memory makes the driver bounce it through a pinned buffer of its own, synchronously), then waits
//! for the copies and checksums the staged bytes. A load reads and verifies into a staging buffer of the device's,
//! then queues host-to-device copies and waits for them. In zero-overhead mode the copies run on the checkpointer's
//! worker during the next forward and backward, which do not write the parameters; order_after_trainer(), called by
//! save() on the trainer's thread, makes them wait for the work the trainer queued before (the optimizer step that
//! produced the values being saved).
//!
//! The CUDA model is ckpt::cuda_checkpoint_device (ckpt/cuda_checkpoint_device.hpp, shardkit::cuda);
//! the ckpt target knows only this interface.
//!
//! ### Named requirement `checkpoint_device<D>`
//! For `d` a D&, `dev` a `const void*` / `void*` into the device's memory, `host` a span of bytes inside an
//! allocation of d.allocate_staging():
//! | expression                       | type / semantics                                                            |
//! |----------------------------------|-----------------------------------------------------------------------------|
//! | `D::checkpoint_device_concept`   | `checkpoint_device_tag` (opting in)                                         |
//! | `d.location()`                   | `shardkit::device`: where the tensors it copies live                        |
//! | `d.allocate_staging(bytes)`      | an `arena_memory` of host memory the device copies to and from fastest      |
//! | `d.order_after_trainer()`        | copies queued after this call see the work the caller's thread queued on    |
//! |                                  | the device before it                                                        |
//! | `d.download(dev, host)`          | queues `host = dev` (`host.size()` bytes); may return before it is done     |
//! | `d.upload(host, dev)`            | queues `dev = host`; `host` must stay unchanged until synchronize() returns |
//! | `d.synchronize()`                | every copy queued so far is complete; throws the device's error if one      |
//! |                                  | failed                                                                      |
//! order_after_trainer() is called on the trainer's thread while the checkpointer's worker may be copying for an
//! earlier save: a model makes the two safe together; the copying calls come from one thread at a time.
//! @code
//!   struct my_device {
//!     using checkpoint_device_concept = shardkit::ckpt::checkpoint_device_tag;
//!     shardkit::device location() const;
//!     my_pinned_memory allocate_staging(std::size_t bytes);
//!     void order_after_trainer();
//!     void download(const void* dev, std::span<std::byte> host);
//!     void upload(std::span<const std::byte> host, void* dev);
//!     void synchronize();
//!   };
//!   shardkit::ckpt::checkpointer ck(pg, sink, {.device = my_device{}});
//! @endcode
#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::ckpt {

//! The tag a type names as `checkpoint_device_concept` to model checkpoint_device.
struct checkpoint_device_tag {};

template <class D>
concept checkpoint_device =
    std::derived_from<typename D::checkpoint_device_concept, checkpoint_device_tag> &&
    requires(D& d, const D& cd, std::size_t bytes, const void* from, void* to, std::span<std::byte> host,
             std::span<const std::byte> chost) {
      { cd.location() } -> std::same_as<device>;
      { d.allocate_staging(bytes) } -> arena_memory;
      d.order_after_trainer();
      d.download(from, host);
      d.upload(chost, to);
      d.synchronize();
    };

//! One allocation of any arena_memory, its type erased (the staging buffer, pageable or a device's page-locked).
class staging_memory {
 public:
  staging_memory() = default;
  template <class M>
    requires(!std::same_as<M, staging_memory> && arena_memory<M>)
  explicit staging_memory(M m) {
    auto owner = std::make_shared<M>(std::move(m));
    size_ = owner->size();
    data_ = std::shared_ptr<std::byte>(owner, owner->data());  // aliasing: the bytes keep their owner alive
  }
  std::byte* data() const noexcept { return data_.get(); }
  std::size_t size() const noexcept { return size_; }

 private:
  std::shared_ptr<std::byte> data_;
  std::size_t size_ = 0;
};

namespace detail {
struct checkpoint_device_interface {
  virtual ~checkpoint_device_interface() = default;
  virtual device location() const = 0;
  virtual staging_memory allocate_staging(std::size_t bytes) = 0;
  virtual void order_after_trainer() = 0;
  virtual void download(const void* from, std::span<std::byte> host) = 0;
  virtual void upload(std::span<const std::byte> host, void* to) = 0;
  virtual void synchronize() = 0;
};
template <class D>
class checkpoint_device_model final : public checkpoint_device_interface {
 public:
  explicit checkpoint_device_model(D d) : d_(std::move(d)) {}
  device location() const override { return d_.location(); }
  staging_memory allocate_staging(std::size_t bytes) override { return staging_memory(d_.allocate_staging(bytes)); }
  void order_after_trainer() override { d_.order_after_trainer(); }
  void download(const void* from, std::span<std::byte> host) override { d_.download(from, host); }
  void upload(std::span<const std::byte> host, void* to) override { d_.upload(host, to); }
  void synchronize() override { d_.synchronize(); }

 private:
  D d_;
};
}  // namespace detail

//! Any checkpoint_device, its type erased; empty by default (a state of host tensors only). Copies share the
//! device.
class any_checkpoint_device {
 public:
  any_checkpoint_device() = default;
  //! Implicit, so that `{.device = ckpt::cuda_checkpoint_device({.device = local_rank})}` reads naturally.
  template <class D>
    requires(!std::same_as<D, any_checkpoint_device> && checkpoint_device<D>)
  any_checkpoint_device(D d)  // NOLINT(google-explicit-constructor)
      : d_(std::make_shared<detail::checkpoint_device_model<D>>(std::move(d))) {}

  explicit operator bool() const noexcept { return d_ != nullptr; }
  device location() const { return d_ ? d_->location() : device::host(); }
  staging_memory allocate_staging(std::size_t bytes) const { return self().allocate_staging(bytes); }
  void order_after_trainer() const { self().order_after_trainer(); }
  void download(const void* from, std::span<std::byte> host) const { self().download(from, host); }
  void upload(std::span<const std::byte> host, void* to) const { self().upload(host, to); }
  void synchronize() const { self().synchronize(); }

  //! Throws errc::invalid_argument unless tensor `name`, on `where`, can be copied by this device.
  void check_serves(device where, const std::string& name, const char* operation) const {
    if (where == device::host()) return;
    if (!d_)
      throw_error(errc::invalid_argument,
                  "tensor '" + name + "' is on " + to_string(where) +
                      ", but the checkpointer has no device to copy it with (checkpointer_options::device)",
                  {.operation = operation, .object = name});
    if (d_->location() != where)
      throw_error(errc::invalid_argument,
                  "tensor '" + name + "' is on " + to_string(where) + ", but the checkpointer's device is " +
                      to_string(d_->location()),
                  {.operation = operation, .object = name});
  }

 private:
  detail::checkpoint_device_interface& self() const {
    if (!d_) throw_error(errc::invalid_argument, "use of an empty any_checkpoint_device", {.operation = "ckpt.device"});
    return *d_;
  }
  std::shared_ptr<detail::checkpoint_device_interface> d_;
};

}  // namespace shardkit::ckpt
