#pragma once
//! unique_resource: the move-only ownership every allocation type needs, written once. A type that owns a
//! mapping, a file descriptor or a CUDA allocation keeps its handles in a small State struct and names how to
//! free them; moving transfers the State and leaves a default (empty) one behind, destruction and reassignment
//! free what is held. The owning type then follows the rule of zero: its moves are the defaulted ones.
//! @code
//!   struct mapping { std::byte* data = nullptr; std::size_t size = 0; };
//!   struct unmap { void operator()(mapping& m) const noexcept { if (m.data) ::munmap(m.data, m.size); } };
//!   shardkit::detail::unique_resource<mapping, unmap> region_;
//! @endcode
#include <type_traits>
#include <utility>

namespace shardkit::detail {

// The requirements are checked where the members are used, not as a constraint: a State declared inside its
// owner (the usual case) with default member initializers is not yet default-constructible while the owner is
// incomplete, which is exactly where the owner declares its unique_resource member.
template <class State, class Release>
class unique_resource {
 public:
  unique_resource() noexcept = default;
  explicit unique_resource(State s) noexcept : state_(std::move(s)) {}
  unique_resource(unique_resource&& o) noexcept : state_(std::exchange(o.state_, State{})) {}
  unique_resource& operator=(unique_resource&& o) noexcept {
    if (this != &o) {
      reset();
      state_ = std::exchange(o.state_, State{});
    }
    return *this;
  }
  unique_resource(const unique_resource&) = delete;
  unique_resource& operator=(const unique_resource&) = delete;
  ~unique_resource() { reset(); }

  //! Frees what is held now and holds nothing (a default State).
  void reset() noexcept {
    static_assert(std::is_nothrow_default_constructible_v<State> && std::is_nothrow_move_assignable_v<State>,
                  "a unique_resource State must be nothrow default-constructible and move-assignable");
    static_assert(std::is_nothrow_invocable_v<const Release&, State&>,
                  "a unique_resource Release must be callable as release(state) and noexcept");
    Release{}(state_);
    state_ = State{};
  }
  State& get() noexcept { return state_; }
  const State& get() const noexcept { return state_; }
  const State* operator->() const noexcept { return &state_; }
  State* operator->() noexcept { return &state_; }

 private:
  State state_{};
};

}  // namespace shardkit::detail
