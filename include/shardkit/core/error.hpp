#pragma once
//! Errors: an enum with its std::error_category, and one exception type that says where it happened.
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>

namespace shardkit {

enum class errc {
  invalid_argument = 1,  //!< the caller passed something the operation cannot accept
  mismatch,              //!< ranks disagree (count, dtype, op, root): detected, not silently mixed
  timeout,               //!< a deadline passed while waiting on a peer or key
  peer_lost,             //!< a connection to a peer closed or failed
  protocol,              //!< bytes from a peer did not follow the wire protocol
  auth_failed,           //!< a handshake carried a wrong token, version or group
  aborted,               //!< the group was aborted (after an earlier error, or by the user)
  closed,                //!< the object was shut down
  backend,               //!< an error reported by an external backend (gloo, NCCL, libfabric)
  io,                    //!< an operating-system I/O error
  unsupported,           //!< the backend cannot do this (dtype, device, op)
  config,                //!< a missing or contradictory setting (environment, options)
  out_of_memory,         //!< an allocation did not fit (an arena's region, the system's memory)
  not_found,             //!< a named object does not exist (a storage sink's object on get)
};

namespace detail {
struct error_category_impl final : std::error_category {
  const char* name() const noexcept override { return "shardkit"; }
  std::string message(int ev) const override {
    switch (static_cast<errc>(ev)) {
      case errc::invalid_argument: return "invalid argument";
      case errc::mismatch: return "ranks disagree";
      case errc::timeout: return "timed out";
      case errc::peer_lost: return "peer lost";
      case errc::protocol: return "protocol error";
      case errc::auth_failed: return "authentication failed";
      case errc::aborted: return "aborted";
      case errc::closed: return "closed";
      case errc::backend: return "backend error";
      case errc::io: return "I/O error";
      case errc::unsupported: return "unsupported";
      case errc::config: return "configuration error";
      case errc::out_of_memory: return "out of memory";
      case errc::not_found: return "not found";
    }
    return "unknown shardkit error";
  }
};
}  // namespace detail

inline const std::error_category& error_category() noexcept {
  static const detail::error_category_impl instance;
  return instance;
}

inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), error_category()}; }

}  // namespace shardkit

template <> struct std::is_error_code_enum<shardkit::errc> : std::true_type {};

namespace shardkit {

//! Where an error happened. Every field is optional; what() prints the ones that are set.
struct error_context {
  std::optional<int> rank;
  std::optional<int> peer;
  std::string operation;  //!< "all_reduce", "store.wait", "tcp.connect", ...
  std::string group;      //!< process group name
  std::string object;     //!< a key, a file, a tensor name
  //! `peer`'s rank in the world (the group every other is split from) where `peer` is a rank of a smaller group:
  //! messages name both, and so does what() ("(peer rank 1, world rank 3)").
  std::optional<int> peer_world_rank;
};

//! The one exception type shardkit throws: an error_code plus the context that makes it actionable.
class error : public std::system_error {
 public:
  error(std::error_code ec, std::string detail, error_context ctx = {})
      : std::system_error(ec), what_(compose(ec, detail, ctx)), detail_(std::move(detail)), context_(std::move(ctx)) {}
  error(errc e, std::string detail, error_context ctx = {}) : error(make_error_code(e), std::move(detail), std::move(ctx)) {}

  //! "shardkit [group G] [rank R] op (peer rank P) 'object': <category message>: <detail>"
  const char* what() const noexcept override { return what_.c_str(); }
  const error_context& context() const noexcept { return context_; }
  const std::string& detail() const noexcept { return detail_; }

  //! The same error with context fields filled in where they were empty (inner layers know less).
  error with_context(const error_context& outer) const {
    error_context c = context_;
    if (!c.rank) c.rank = outer.rank;
    if (!c.peer) c.peer = outer.peer;
    if (c.operation.empty()) c.operation = outer.operation;
    if (c.group.empty()) c.group = outer.group;
    if (c.object.empty()) c.object = outer.object;
    if (!c.peer_world_rank) c.peer_world_rank = outer.peer_world_rank;
    return error(code(), detail_, std::move(c));
  }

 private:
  static std::string compose(std::error_code ec, const std::string& detail, const error_context& c) {
    std::ostringstream os;
    os << "shardkit";
    if (!c.group.empty()) os << " [group " << c.group << "]";
    if (c.rank) os << " [rank " << *c.rank << "]";
    if (!c.operation.empty()) os << " " << c.operation;
    if (c.peer) {
      os << " (peer rank " << *c.peer;
      if (c.peer_world_rank && *c.peer_world_rank != *c.peer) os << ", world rank " << *c.peer_world_rank;
      os << ")";
    }
    if (!c.object.empty()) os << " '" << c.object << "'";
    os << ": " << ec.message();
    if (!detail.empty()) os << ": " << detail;
    return os.str();
  }

  std::string what_;
  std::string detail_;
  error_context context_;
};

[[noreturn]] inline void throw_error(errc e, std::string detail, error_context ctx = {}) {
  throw error(e, std::move(detail), std::move(ctx));
}

}  // namespace shardkit
