#pragma once
//! unit_scope: a unit of a sharded_model (fsdp/sharded_model.hpp) while the trainer uses it in a pass, and what it
//! reads and writes through it. Its member bodies are sharded_model's (fsdp/impl/sharded_model_passes.hpp).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/buffer.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/fsdp/options.hpp"

namespace shardkit::fsdp {

class sharded_model;

//! A unit while the trainer uses it in a pass: its gathered parameters (and in backward its unsharded
//! gradients, to accumulate into). Ends (frees or reduces) when the pass moves on, end_unit() is called or the
//! pass is left early; from then on its accessors throw errc::invalid_argument (errc::closed once its model is
//! destroyed; name() is then empty) (a copy kept past its unit would
//! otherwise read whatever the limiter's region holds next), and spans taken from it must not be used: under
//! SHARDKIT_DEBUG=detail (host gather device) such a read or write aborts, naming the unit and its pass
//! (fsdp/detail/view_quarantine.hpp).
class unit_scope {
 public:
  std::size_t index() const noexcept { return index_; }
  SHARDKIT_DECL const std::string& name() const noexcept;
  fsdp::pass pass() const noexcept { return pass_; }

  //! All gathered parameters, flat, in the parameter dtype. The views name the model's gather device (dev()); on a
  //! GPU they, and the spans of the typed accessors, are device memory: for kernels and copies, not host reads.
  const_buffer_view params() const {
    check_current("params");
    return params_;
  }
  SHARDKIT_DECL const_buffer_view param(std::string_view name) const;
  template <element_type T>
  std::span<const T> param(std::string_view name) const {
    return typed<const T>(param(name), name, "param");
  }
  //! Backward only: the unit's unsharded gradients in the reduce dtype, zeroed before the first micro-batch;
  //! the trainer adds into them.
  SHARDKIT_DECL buffer_view grads() const;
  SHARDKIT_DECL buffer_view grad(std::string_view name) const;
  template <element_type T>
  std::span<T> grad(std::string_view name) const {
    return typed<T>(grad(name), name, "grad");
  }
  //! The parameter's shape.
  SHARDKIT_DECL const std::vector<std::size_t>& shape(std::string_view name) const;

 private:
  friend class sharded_model;
  SHARDKIT_DECL const sharded_model& live_model(const char* what) const;
  SHARDKIT_DECL void check_current(const char* what) const;
  template <class T, class View>
  std::span<T> typed(View v, std::string_view name, const char* what) const {
    if (v.type() != dtype_v<T>)
      throw_error(errc::invalid_argument,
                  std::string(what) + " '" + std::string(name) + "' is " + std::string(to_string(v.type())) +
                      ", not " + std::string(to_string(dtype_v<T>)) + " (see sharding_options::precision)",
                  {.operation = "fsdp.unit", .object = std::string(name)});
    return {reinterpret_cast<T*>(const_cast<std::byte*>(reinterpret_cast<const std::byte*>(v.data()))), v.count()};
  }
  const sharded_model* model_ = nullptr;
  std::weak_ptr<const int> model_alive_;  // expires when the model is destroyed: then errc::closed, not a read
  std::size_t index_ = 0;
  fsdp::pass pass_ = pass::forward;
  std::uint64_t generation_ = 0;  // the unit's generation when this scope began
  const_buffer_view params_;
  buffer_view grads_;
};

}  // namespace shardkit::fsdp

// A unit_scope comes only from a sharded_model, whose impl holds its member bodies (after unit_scope is complete,
// whichever header came first).
#include "shardkit/fsdp/sharded_model.hpp"
