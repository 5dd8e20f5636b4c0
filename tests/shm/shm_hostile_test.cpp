// Hostile shared-memory segments: a peer's segment is memory this rank maps and then trusts, so every field of
// its header that sizes or places anything must be checked before use. Each case crafts a segment under the name
// a peer would publish and maps it as connect does: it must be refused with errc::protocol naming the segment,
// never mapped past its end.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>

#include "shardkit/transport/shm.hpp"

namespace shm = shardkit::transport::detail::shm;
using shardkit::errc;

namespace {

//! A POSIX shm object of `bytes` holding a valid header for (session, rank 1 of 3), then `edit` applied to it.
struct crafted_segment {
  std::string name = "/shardkit-hostile-" + std::to_string(::getpid());
  crafted_segment(std::size_t bytes, const std::function<void(shm::segment_header&)>& edit, std::size_t header_bytes = 0) {
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, off_t(bytes)) == 0);
    shm::segment_header h;
    const shm::segment_layout layout(4096, 2);
    h.magic = shm::segment_magic;
    h.version = shm::segment_version;
    h.rank = 1;
    h.size = 3;
    h.ring_count = 2;
    h.ring_bytes = 4096;
    h.controls_offset = layout.controls_offset;
    h.data_offset = layout.data_offset;
    h.total_bytes = bytes;
    std::snprintf(h.session, sizeof h.session, "%s", "sess");
    edit(h);
    const std::size_t n = header_bytes ? header_bytes : std::min(bytes, sizeof h);
    REQUIRE(::pwrite(fd, &h, n, 0) == ssize_t(n));
    ::close(fd);
  }
  ~crafted_segment() { ::shm_unlink(name.c_str()); }
};

void refused(const crafted_segment& s, const std::string& why) {
  CAPTURE(why);
  try {
    (void)shm::open_segment(s.name, "sess", 1, 3);
    FAIL("a hostile segment was accepted: " << why);
  } catch (const shardkit::error& e) {
    CHECK(e.code() == shardkit::make_error_code(errc::protocol));
    CHECK(std::string(e.what()).find(s.name) != std::string::npos);
    MESSAGE(why << ": " << std::string(e.what()));
  }
}

}  // namespace

TEST_CASE("[shm] a valid crafted segment is accepted (the hostile cases below differ from it in one field)") {
  const std::size_t total = shm::segment_layout(4096, 2).total_bytes;
  crafted_segment s(total, [](shm::segment_header&) {});
  CHECK_NOTHROW((void)shm::open_segment(s.name, "sess", 1, 3));
}

TEST_CASE("[shm] hostile segments are refused with errc::protocol, never mapped past their end") {
  const std::size_t total = shm::segment_layout(4096, 2).total_bytes;
  SUBCASE("empty") { refused(crafted_segment(0, [](auto&) {}), "an empty object"); }
  SUBCASE("shorter than a header") { refused(crafted_segment(16, [](auto&) {}), "16 bytes"); }
  SUBCASE("bad magic") { refused(crafted_segment(total, [](auto& h) { h.magic = 0x4141414141414141ULL; }), "magic"); }
  SUBCASE("other version") { refused(crafted_segment(total, [](auto& h) { h.version = 99; }), "version"); }
  SUBCASE("another rank's") { refused(crafted_segment(total, [](auto& h) { h.rank = 2; }), "rank"); }
  SUBCASE("another session's") {
    refused(crafted_segment(total, [](auto& h) { std::snprintf(h.session, sizeof h.session, "other"); }), "session");
  }
  SUBCASE("a session name without its terminating NUL") {
    refused(crafted_segment(total, [](auto& h) { std::memset(h.session, 's', sizeof h.session); }), "unterminated session");
  }
  SUBCASE("total_bytes larger than the object") {
    refused(crafted_segment(total, [&](auto& h) { h.total_bytes = total * 2; }), "total_bytes");
  }
  SUBCASE("a ring size that is not a power of two") {
    refused(crafted_segment(total, [](auto& h) { h.ring_bytes = 5000; }), "ring_bytes 5000");
  }
  SUBCASE("a ring size whose layout overflows 64 bits back to the object's size") {
    // 2 rings of 2^63 bytes: data_offset + 2 * 2^63 wraps to data_offset, the size of this object.
    const std::size_t small = shm::segment_layout(4096, 2).data_offset;
    refused(crafted_segment(small, [&](auto& h) {
              h.ring_bytes = std::uint64_t(1) << 63;
              h.total_bytes = small;
            }),
            "ring_bytes 2^63");
  }
  SUBCASE("rings placed past the end (data_offset)") {
    refused(crafted_segment(total, [&](auto& h) { h.data_offset = total; }), "data_offset");
  }
  SUBCASE("ring controls placed past the end (controls_offset)") {
    refused(crafted_segment(total, [&](auto& h) { h.controls_offset = total - 64; }), "controls_offset");
  }
}
