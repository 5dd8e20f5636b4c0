// flat_arena: planning, alignment and padding, typed views, errors; the bounds checks of buffer_view::slice and
// host_shared_memory::as. The collectives over an arena's views, ranks as processes: tests/comm/arena_collectives_test.cpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "shardkit/core/arena.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/host_shared_memory.hpp"

using namespace shardkit;

namespace {

std::uintptr_t address(const_buffer_view v) { return reinterpret_cast<std::uintptr_t>(v.data()); }

// Runs `f`, which must throw shardkit::error with `code`; returns its what() for the caller to check.
template <class F>
std::string error_of(F&& f, errc code) {
  try {
    f();
  } catch (const error& e) {
    CHECK(e.code() == make_error_code(code));
    return e.what();
  }
  FAIL("no error thrown");
  return {};
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

static_assert(arena_memory<host_shared_memory>);
static_assert(arena_memory<page_aligned_memory>);
static_assert(!arena_memory<std::vector<std::byte>>);  // not opted in
template <class T>
concept viewable_as = requires(const host_shared_memory& m) { m.as<T>(); };
static_assert(!viewable_as<std::string>);  // not trivially copyable
static_assert(viewable_as<float>);

TEST_CASE("[core] arena_plan lays out aligned, padded buffers; an arena made from it holds them exactly") {
  arena_plan plan;
  CHECK(plan.alignment() == 64);
  CHECK(plan.add(dtype::bf16, 1000, "unit0.params") == 0);   // 2000 bytes -> 2048
  CHECK(plan.add(dtype::f32, 1000, "unit0.grads") == 2048);  // 4000 -> 4032
  CHECK(plan.add(dtype::u8, 1, "flag") == 6080);             // 1 -> 64
  CHECK(plan.add(dtype::f64, 0, "empty") == 6144);           // 0 -> 0
  CHECK(plan.add(dtype::i64, 8) == 6144);                    // 64 -> 64, unnamed
  CHECK(plan.bytes() == 6208);
  REQUIRE(plan.slots().size() == 5);
  CHECK(plan.slots()[1].bytes == 4032);

  flat_arena arena(plan, "fsdp");
  CHECK(arena.capacity() == plan.bytes());
  CHECK(arena.name() == "fsdp");
  const std::vector<buffer_view> views = arena.allocate(plan);
  CHECK(arena.used() == plan.bytes());
  CHECK(arena.remaining() == 0);
  REQUIRE(views.size() == 5);
  for (std::size_t i = 0; i < views.size(); ++i) {
    CAPTURE(i);
    CHECK(address(views[i]) % 64 == 0);
    CHECK(views[i].data() == arena.memory().data() + plan.slots()[i].offset);
    CHECK(views[i].type() == plan.slots()[i].type);
    CHECK(views[i].count() == plan.slots()[i].count);
    CHECK(views[i].dev() == device::host());
  }
  CHECK(views[0].size_bytes() == 2000);
  CHECK_FALSE(overlaps(views[0], views[1]));
  CHECK(arena.view("unit0.grads").data() == views[1].data());
  CHECK(arena.slots().size() == 5);

  // Typed access: spans of the right dtype, zeroed, writable through either handle.
  std::span<float> grads = arena.span<float>("unit0.grads");
  REQUIRE(grads.size() == 1000);
  CHECK(grads[999] == 0.0f);
  grads[3] = 2.5f;
  CHECK(views[1].as<float>()[3] == 2.5f);
  CHECK(arena.span<bfloat16>("unit0.params").size() == 1000);
}

TEST_CASE("[core] flat_arena: views at every alignment, typed allocation, padding between neighbours") {
  for (std::size_t alignment : {std::size_t(1), std::size_t(8), std::size_t(64), std::size_t(256), std::size_t(4096)}) {
    CAPTURE(alignment);
    flat_arena arena(1 << 20, alignment);
    CHECK(arena.alignment() == alignment);
    std::uintptr_t end = reinterpret_cast<std::uintptr_t>(arena.memory().data());
    for (std::size_t i = 0; i < 20; ++i) {
      const dtype t = all_dtypes[i % std::size(all_dtypes)];
      const std::size_t count = 3 + 17 * i;
      const buffer_view v = arena.allocate(t, count, "v" + std::to_string(i));
      CHECK(address(v) % alignment == 0);
      CHECK(address(v) % size_of(t) == 0);
      CHECK(address(v) >= end);                                       // after the previous one, never over it
      CHECK(address(v) - end < std::max(alignment, size_of(t)));  // a gap below one alignment (or element) unit
      end = address(v) + v.size_bytes();
    }
    CHECK(arena.used() % alignment == 0);
  }
  staging_arena staging(4096 * 3);
  std::span<double> d = staging.allocate<double>(100, "d");
  std::span<std::int32_t> i = staging.allocate<std::int32_t>(7);
  CHECK(d.size() == 100);
  CHECK(reinterpret_cast<std::uintptr_t>(i.data()) - reinterpret_cast<std::uintptr_t>(d.data()) == 832);  // 800 -> 832
  CHECK(staging.view("d").type() == dtype::f64);
  d[99] = 1.0;
  CHECK(staging.span<double>("d")[99] == 1.0);
}

TEST_CASE("[core] flat_arena: exhaustion and bad requests are clear errors naming the request and the region") {
  flat_arena arena(1000, 64, "params");
  CHECK(arena.capacity() == 1024);  // rounded up to the alignment: the last view's padding fits
  arena.allocate(dtype::f32, 200, "a");  // 800 -> 832
  const std::string full = error_of([&] { arena.allocate(dtype::bf16, 100, "layer7.grads"); }, errc::out_of_memory);
  CHECK(contains(full, "flat_arena 'params' allocate 'layer7.grads'"));
  CHECK(contains(full, "100 bf16 elements"));
  CHECK(contains(full, "(256 bytes padded to 64)"));  // 200 -> 256
  CHECK(contains(full, "host_shared_memory has 1024 bytes, 832 used, 192 left"));
  CHECK(arena.used() == 832);  // a failed request takes nothing
  CHECK(error_of([&] { arena.allocate(dtype::u8, 193); }, errc::out_of_memory).find("a request of 193 u8") != std::string::npos);
  CHECK(arena.allocate(dtype::u8, 192, "rest").count() == 192);  // exactly what is left
  CHECK(arena.remaining() == 0);
  CHECK(arena.allocate(dtype::f32, 0, "nothing").empty());  // zero elements still fit in a full arena
  error_of([&] { arena.allocate(dtype::f32, 1); }, errc::out_of_memory);

  CHECK(contains(error_of([&] { arena.allocate(dtype::u8, 0, "a"); }, errc::invalid_argument), "'a' was already allocated"));
  CHECK(contains(error_of([&] { arena.allocate(dtype::f64, std::numeric_limits<std::size_t>::max() / 4, "huge"); }, errc::invalid_argument),
                 "too large to address"));
  CHECK(contains(error_of([&] { (void)arena.view("missing"); }, errc::invalid_argument), "no view named 'missing' (3 allocated)"));
  CHECK(contains(error_of([&] { (void)arena.span<double>("a"); }, errc::invalid_argument), "'a' holds f32, not f64"));
  for (std::size_t bad : {std::size_t(0), std::size_t(48), std::size_t(8192)}) {
    CAPTURE(bad);
    CHECK(contains(error_of([&] { arena_plan p(bad); }, errc::invalid_argument), "is not a power of two between 1 and 4096"));
    error_of([&] { flat_arena a(64, bad); }, errc::invalid_argument);
  }
  arena_plan plan;
  plan.add(dtype::u8, std::numeric_limits<std::size_t>::max() - 4096);
  CHECK(contains(error_of([&] { plan.add(dtype::u8, 8192, "one too many"); }, errc::invalid_argument), "passes the address space"));
}

TEST_CASE("[core] flat_arena: every view is found in the host_shared_memory registry, one allocation at its offset") {
  flat_arena arena(1 << 20, 1);  // alignment 1: views at odd offsets too
  const auto region = find_host_shared(arena.memory().data(), arena.capacity());
  REQUIRE(region);
  buffer_view first;
  for (int i = 0; i < 64; ++i) {
    CAPTURE(i);
    const buffer_view v = arena.allocate(i % 4 ? dtype::u8 : dtype::bf16, std::size_t(101 + i));
    if (i == 0) first = v;
    const auto where = find_host_shared(v.data(), v.size_bytes());
    REQUIRE(where);
    CHECK(where->fd == region->fd);
    CHECK(where->inode == region->inode);
    CHECK(where->size == arena.capacity());
    CHECK(where->offset == arena.slots().back().offset);
  }
  CHECK(arena.slots()[3].offset == 407);  // 202 + 102 + 103: u8 at an odd offset
  CHECK(arena.slots()[4].offset == 512);  // bf16 after 407 + 104 = 511: element-aligned even at alignment 1

  // Moving the arena moves neither region nor views; the moved-from one is empty.
  flat_arena moved = std::move(arena);
  CHECK(moved.slots().size() == 64);
  CHECK(moved.memory().data() == first.data());
  CHECK(find_host_shared(first.data(), first.size_bytes()).has_value());
  CHECK(arena.capacity() == 0);   // NOLINT(bugprone-use-after-move): moved-from state is specified
  CHECK(arena.remaining() == 0);  // NOLINT(bugprone-use-after-move)
  const std::byte* base = moved.memory().data();
  moved = flat_arena();
  CHECK_FALSE(find_host_shared(base, 1));  // the region went with its arena
}

TEST_CASE("[core] buffer_view::slice checks its bounds, naming offset, count and size") {
  std::vector<float> v(10);
  buffer_view b{std::span<float>(v)};
  const_buffer_view c = b;
  CHECK(b.slice(10, 0).empty());
  CHECK(b.slice(4, 6).count() == 6);
  CHECK(c.slice(0, 10).data() == c.data());
  const std::string past = error_of([&] { (void)b.slice(4, 7); }, errc::invalid_argument);
  CHECK(contains(past, "slice of 7 elements at offset 4 runs past the end of a view of 10 f32 elements"));
  error_of([&] { (void)c.slice(11, 0); }, errc::invalid_argument);
  error_of([&] { (void)c.slice(1, std::numeric_limits<std::size_t>::max()); }, errc::invalid_argument);  // offset + n wraps
}

TEST_CASE("[core] host_shared_memory::as needs a whole number of elements") {
  host_shared_memory mem(4096 + 2);
  CHECK(mem.as<std::uint16_t>().size() == 2049);
  CHECK(contains(error_of([&] { (void)mem.as<float>(); }, errc::invalid_argument),
                 "an allocation of 4098 bytes is not a whole number of 4-byte elements"));
  CHECK(host_shared_memory().as<double>().empty());
}
