#pragma once
//! Where a sharded_model keeps what the trainer computes with: the gather_device named requirement, the host's
//! model of it (host_gather_device, the default) and any_gather_device, the erasure sharding_options::device holds.
//!
//! The split is ZeRO-Offload's: the f32 master shard, the f32 gradient shard and the optimizer state stay in host
//! memory whatever the device. What lives on the gather device is the rate limiter's region (the gathered
//! parameters in the parameter dtype, the unsharded gradients in the reduce dtype) and the gradients kept across
//! micro-batches. The device supplies that memory and a **stager** that moves data between it and the host shards,
//! converting dtypes on the host, so the library needs no kernel of its own: a gather uploads this rank's master
//! shard into its slot of the gathered buffer, a reduction adds this rank's reduced slot into the f32 gradient
//! shard, and a new gradient buffer is zeroed on the device. The collectives themselves run on the device (the
//! groups' backend must accept buffers on location()).
//!
//! The CUDA model is fsdp::cuda_gather_device (fsdp/cuda_gather_device.hpp, shardkit::cuda); the core
//! target knows only this interface.
//!
//! ### Named requirement `gather_device<D>`
//! | expression                  | type / semantics                                                              |
//! |-----------------------------|-------------------------------------------------------------------------------|
//! | `D::gather_device_concept`  | `gather_device_tag` (opting in)                                               |
//! | `d.location()`              | `shardkit::device`: where allocate() puts memory                              |
//! | `d.allocate(bytes)`         | an `arena_memory` of `bytes` in that memory (contents unspecified); its       |
//! |                             | `location()`, if it has one, is `d.location()`                                |
//! | `d.make_stager()`           | a `device_stager` (below), used by one thread at a time                       |
//! | copies of `d`               | name the same device (sharding_options is copied)                             |
//!
//! ### Named requirement `device_stager<S>`
//! Every call returns when its effect is complete and visible to what the caller does next (a collective on
//! another stream, the trainer's kernels); views on the device side are allocations of the device's (or slices).
//! | expression                           | semantics                                                            |
//! |--------------------------------------|----------------------------------------------------------------------|
//! | `s.upload(const_buffer_view host, buffer_view dev)`   | `dev = host`, converted to `dev.type()`             |
//! | `s.download(const_buffer_view dev, buffer_view host)` | `host = dev`, converted to `host.type()`            |
//! | `s.add_to_host(const_buffer_view dev, std::span<float> host)` | `host[i] += float(dev[i])`                   |
//! | `s.zero(buffer_view dev)`            | every byte of `dev` is 0                                             |
//! The two sides always hold the same number of elements (any_device_stager checks it once for every model).
//! @code
//!   struct my_device {
//!     using gather_device_concept = shardkit::fsdp::gather_device_tag;
//!     shardkit::device location() const;
//!     my_memory allocate(std::size_t bytes) const;   // an arena_memory with location()
//!     my_stager make_stager() const;
//!   };
//!   shardkit::fsdp::sharded_model model(group, units, {.device = my_device{}});
//! @endcode
#include <concepts>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/core/host_shared_memory.hpp"
#include "shardkit/fsdp/rate_limiter.hpp"

namespace shardkit::fsdp {

//! The tag a type names as `gather_device_concept` to model gather_device.
struct gather_device_tag {};

namespace detail {

//! dst += src, src of any floating dtype (the reduced gradient in the reduce dtype).
inline void add_into(const_buffer_view src, std::span<float> dst) {
  visit_dtype(src.type(), [&](auto tag) {
    using T = decltype(tag);
    const T* in = reinterpret_cast<const T*>(src.data());
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] += float(in[i]);
  });
}

}  // namespace detail

//! Moves data between host memory and a gather device's memory (see the table above).
template <class S>
concept device_stager = requires(S& s, const_buffer_view in, buffer_view out, std::span<float> host) {
  s.upload(in, out);
  s.download(in, out);
  s.add_to_host(in, host);
  s.zero(out);
};

//! The memory and copies a sharded_model needs from the device it gathers onto (see the table above).
template <class D>
concept gather_device = std::derived_from<typename D::gather_device_concept, gather_device_tag> &&
                        std::copy_constructible<D> && requires(const D& d, std::size_t bytes) {
                          { d.location() } -> std::same_as<device>;
                          { d.allocate(bytes) } -> arena_memory;
                          { d.make_stager() } -> device_stager;
                        };

//! One allocation of any arena_memory, its type erased, with the device it lives on: the rate limiter's region
//! and the accumulation buffers of a sharded_model, whatever its gather device. `gather_memory(bytes)` is
//! host_shared_memory (the host path's region).
class gather_memory {
 public:
  using arena_memory_concept = arena_memory_tag;
  static constexpr std::string_view memory_name = "gather_memory";

  gather_memory() = default;
  explicit gather_memory(std::size_t bytes) : gather_memory(host_shared_memory(bytes)) {}
  //! Takes `m` over (its address does not change); the location is m.location() where M has one, else the host.
  template <class M>
    requires(!std::same_as<M, gather_memory> && arena_memory<M>)  // in this order: no recursion on itself
  explicit gather_memory(M m)
      : owner_(new M(std::move(m)), [](void* p) { delete static_cast<M*>(p); }),
        data_(static_cast<M*>(owner_.get())->data()),
        size_(static_cast<M*>(owner_.get())->size()),
        location_(detail::memory_location(*static_cast<M*>(owner_.get()))) {}
  gather_memory(gather_memory&& o) noexcept
      : owner_(std::move(o.owner_)),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        location_(o.location_) {}
  gather_memory& operator=(gather_memory&& o) noexcept {
    if (this != &o) {
      owner_ = std::move(o.owner_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      location_ = o.location_;
    }
    return *this;
  }
  gather_memory(const gather_memory&) = delete;
  gather_memory& operator=(const gather_memory&) = delete;

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  device location() const noexcept { return location_; }
  //! count elements of type at byte offset `at`, tagged with the location.
  buffer_view view(dtype type, std::size_t count, std::size_t at = 0) const noexcept {
    return {data_ + at, count, type, location_};
  }

 private:
  std::unique_ptr<void, void (*)(void*)> owner_{nullptr, [](void*) {}};
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  device location_{};
};

static_assert(arena_memory<gather_memory>);

//! The default gather device: host memory (host_shared_memory, so local peers can map the limiter's region), with
//! conversions and copies done in place.
class host_gather_device {
 public:
  using gather_device_concept = gather_device_tag;

  class stager {
   public:
    void upload(const_buffer_view host, buffer_view dev) {
      convert(host.type(), host.data(), dev.type(), dev.data(), dev.count());
    }
    void download(const_buffer_view dev, buffer_view host) {
      convert(dev.type(), dev.data(), host.type(), host.data(), host.count());
    }
    void add_to_host(const_buffer_view dev, std::span<float> host) { detail::add_into(dev, host); }
    void zero(buffer_view dev) {
      if (dev.size_bytes()) std::memset(dev.data(), 0, dev.size_bytes());
    }
  };

  device location() const noexcept { return device::host(); }
  host_shared_memory allocate(std::size_t bytes) const { return host_shared_memory(bytes); }
  stager make_stager() const noexcept { return {}; }
};

static_assert(gather_device<host_gather_device>);

namespace detail {

struct stager_interface {
  virtual ~stager_interface() = default;
  virtual void upload(const_buffer_view, buffer_view) = 0;
  virtual void download(const_buffer_view, buffer_view) = 0;
  virtual void add_to_host(const_buffer_view, std::span<float>) = 0;
  virtual void zero(buffer_view) = 0;
};

template <device_stager S>
class stager_model final : public stager_interface {
 public:
  explicit stager_model(S s) : s_(std::move(s)) {}
  void upload(const_buffer_view h, buffer_view d) override { s_.upload(h, d); }
  void download(const_buffer_view d, buffer_view h) override { s_.download(d, h); }
  void add_to_host(const_buffer_view d, std::span<float> h) override { s_.add_to_host(d, h); }
  void zero(buffer_view d) override { s_.zero(d); }

 private:
  S s_;
};

struct gather_device_interface {
  virtual ~gather_device_interface() = default;
  virtual device location() const = 0;
  virtual gather_memory allocate(std::size_t) const = 0;
  virtual std::unique_ptr<stager_interface> make_stager() const = 0;
};

template <gather_device D>
class gather_device_model final : public gather_device_interface {
 public:
  explicit gather_device_model(D d) : d_(std::move(d)) {}
  device location() const override { return d_.location(); }
  gather_memory allocate(std::size_t bytes) const override { return gather_memory(d_.allocate(bytes)); }
  std::unique_ptr<stager_interface> make_stager() const override {
    return std::make_unique<stager_model<decltype(d_.make_stager())>>(d_.make_stager());
  }

 private:
  D d_;
};

}  // namespace detail

//! A device_stager of any gather device, its type erased; checks that both sides of a copy hold the same number of
//! elements. Move-only; one thread at a time.
class any_device_stager {
 public:
  any_device_stager() = default;
  explicit any_device_stager(std::unique_ptr<detail::stager_interface> s) noexcept : s_(std::move(s)) {}

  void upload(const_buffer_view host, buffer_view dev) {
    check("upload", host.count(), dev.count());
    self().upload(host, dev);
  }
  void download(const_buffer_view dev, buffer_view host) {
    check("download", dev.count(), host.count());
    self().download(dev, host);
  }
  void add_to_host(const_buffer_view dev, std::span<float> host) {
    check("add_to_host", dev.count(), host.size());
    self().add_to_host(dev, host);
  }
  void zero(buffer_view dev) { self().zero(dev); }

 private:
  static void check(const char* op, std::size_t a, std::size_t b) {
    if (a != b)
      throw_error(errc::invalid_argument,
                  std::string(op) + " between " + std::to_string(a) + " and " + std::to_string(b) + " elements",
                  {.operation = std::string("fsdp.stager.") + op});
  }
  detail::stager_interface& self() const {
    if (!s_) throw_error(errc::invalid_argument, "use of an empty any_device_stager", {.operation = "fsdp.stager"});
    return *s_;
  }
  std::unique_ptr<detail::stager_interface> s_;
};

//! Any gather_device, its type erased: what sharding_options::device holds. Default: host_gather_device. Cheap to
//! copy (copies share the model).
class any_gather_device {
 public:
  any_gather_device() : d_(host()) {}
  //! Implicit, so that `{.device = fsdp::cuda_gather_device({.device = local_rank})}` reads naturally.
  template <class D>
    requires(!std::same_as<D, any_gather_device> && gather_device<D>)
  any_gather_device(D d)  // NOLINT(google-explicit-constructor)
      : d_(std::make_shared<const detail::gather_device_model<D>>(std::move(d))) {}

  device location() const { return d_->location(); }
  bool on_host() const { return location() == device::host(); }
  //! `bytes` of the device's memory (contents unspecified).
  gather_memory allocate(std::size_t bytes) const { return d_->allocate(bytes); }
  any_device_stager make_stager() const { return any_device_stager(d_->make_stager()); }

 private:
  // The default's model, made once (fsdp/impl/device.hpp: the host stager's conversions compile where it is).
  static std::shared_ptr<const detail::gather_device_interface> host();
  std::shared_ptr<const detail::gather_device_interface> d_;
};

}  // namespace shardkit::fsdp

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/fsdp/impl/device.hpp"
#endif
