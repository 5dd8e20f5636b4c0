#pragma once
// Environment variables for one scope of a test, and the message of a settings error.
#include <doctest/doctest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "shardkit/core/error.hpp"

namespace shardkit::test {

//! Sets (or unsets, with nullptr) one variable for a scope and restores it after.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~scoped_env() {
    if (saved_) ::setenv(name_.c_str(), saved_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

//! The message of the errc::config `f` throws ("" when it throws nothing; a failed CHECK when another code).
template <class F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const shardkit::error& e) {
    CHECK(e.code() == shardkit::errc::config);
    return e.detail();
  }
  return "";
}

}  // namespace shardkit::test
