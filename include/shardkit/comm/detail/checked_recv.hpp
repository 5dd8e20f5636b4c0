#pragma once
//! The point-to-point recv contract every communicator keeps: the message must be exactly the size the receiver
//! expected (the communicator API has no "up to n bytes" recv), and failures carry the group's context.
#include <exception>
#include <string>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm::detail {

//! Adds `ctx` to a transport failure; non-shardkit exceptions pass through unchanged.
inline std::exception_ptr with_context(std::exception_ptr e, const error_context& ctx) {
  try {
    std::rethrow_exception(e);
  } catch (const error& err) {
    return std::make_exception_ptr(err.with_context(ctx));
  } catch (...) {
    return std::current_exception();
  }
}

//! A completion that ends as `got` does, except that a message of another size than `expected` fails with
//! errc::mismatch. `translate` turns the transport's failure into the communicator's (context, error codes).
template <class Translate = decltype(&with_context)>
completion checked_recv(completion got, std::size_t expected, error_context ctx, Translate translate = &with_context) {
  completion_source result;
  got.then([got, result, expected, ctx = std::move(ctx), translate] {
    if (auto e = got.exception()) {
      result.set_error(translate(e, ctx));
    } else if (got.bytes() != expected) {
      result.set_error(error(errc::mismatch,
                             "message of " + std::to_string(got.bytes()) + " bytes where " + std::to_string(expected) +
                                 " were expected: sender and receiver disagree on the size",
                             ctx));
    } else {
      result.set_done(got.bytes());
    }
  });
  result.on_cancel([got] { return got.cancel(); });
  return result;
}

}  // namespace shardkit::comm::detail
