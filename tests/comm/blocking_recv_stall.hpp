#pragma once
// A blocking recv on a communicator itself (no process_group) whose sender is late writes the stall line, as
// process_group's recv does: shared by the communicators that wait on their own isend and irecv (any_communicator in
// comm_process_test, gloo_communicator in gloo_test).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <regex>
#include <span>
#include <thread>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "support/harness.hpp"

namespace shardkit::test {

// `receiver` (rank 1) blocks in a recv of 16 bytes with tag 7 from rank 0, its stall line due after 50 ms
// (collective_options::stall_log), long before its deadline (60 s). `sender` (rank 0) sends only once the line names
// rank 0 (or after 30 s: then no line came).
template <class C>
void check_blocking_recv_logs_stall_line(C& sender, C& receiver) {
  std::vector<float> got(4), sent{1, 2, 3, 4};
  const std::regex line(R"(\[shardkit WARN [0-9:.]+( rank [0-9]+)?\] rank 1 has waited [0-9.]+ s for rank 0 in recv with tag 7 )"
                        R"(\(16 bytes\) of group 'pairs' \(receiving from it\): it is slow, stuck, stopped, or has not called )"
                        R"(send with tag 7; the call times out in [0-9.]+ s\n)");
  stderr_capture log;
  const auto said = [&] { return std::regex_search(log.text(), line); };
  std::exception_ptr failed;
  std::atomic<bool> returned{false};
  std::thread receiving([&] {
    try {
      receiver.recv(buffer_view(std::span<float>(got)), 0, 7,
                    {.until = deadline_after(std::chrono::seconds(60)), .group = "pairs", .stall_log = std::chrono::milliseconds(50)});
    } catch (...) {
      failed = std::current_exception();
    }
    returned = true;
  });
  for (int i = 0; i < 3000 && !said() && !returned; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  sender.send(const_buffer_view(std::span<const float>(sent)), 1, 7, {.until = deadline_after(std::chrono::seconds(60))});
  receiving.join();
  log.restore();
  const std::string text = log.text();
  CAPTURE(text);
  CHECK(said());
  if (failed) std::rethrow_exception(failed);
  CHECK(got == sent);
}

}  // namespace shardkit::test
