// The CUDA runtime half of the host-memory model of CUDA and NCCL (see cuda_nccl_model.cpp for the whole model
// and its NCCL half): "device" memory is host memory, but recorded, so copies refuse pointers on the wrong side
// (as a GPU would); page-locked host memory (cudaHostAlloc) is recorded as well, and copies to and from it run
// asynchronously in stream order as on a GPU, so a missing synchronisation reads stale bytes here too; each stream
// is a thread running its queue in order (the legacy stream runs work inline, or with
// SHARDKIT_MODEL_CUDA_ASYNC_LEGACY=1 on a thread of its own like the others, so that a copy on another stream that
// does not wait for the legacy stream's kernels reads what they have not written yet); events are flags set by the
// stream. SHARDKIT_MODEL_CUDA_DEVICES sets the number of devices (default 4), of which CUDA_VISIBLE_DEVICES picks
// the ones the process sees, as CUDA does; cudaSetDevice refuses an ordinal the process does not see.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nccl/cuda_model_internal.hpp"

using cuda_model::device_or_complain;
using cuda_model::run_on;

namespace {

thread_local int current_device = 0;

// The physical devices (SHARDKIT_MODEL_CUDA_DEVICES, default 4) the process sees, by ordinal: CUDA_VISIBLE_DEVICES
// read as CUDA reads it, a comma-separated list of indices up to its first entry that is not one of an unused
// device ("" and "-1" see none).
std::vector<int> visible_devices() {
  const char* v = std::getenv("SHARDKIT_MODEL_CUDA_DEVICES");
  const int physical = v ? std::atoi(v) : 4;
  std::vector<int> seen;
  const char* list = std::getenv("CUDA_VISIBLE_DEVICES");
  if (!list) {
    for (int i = 0; i < physical; ++i) seen.push_back(i);
    return seen;
  }
  const std::string all = list;
  for (std::size_t from = 0; from <= all.size();) {
    std::size_t to = all.find(',', from);
    if (to == std::string::npos) to = all.size();
    const std::string entry = all.substr(from, to - from);
    char* end = nullptr;
    const long i = std::strtol(entry.c_str(), &end, 10);
    if (entry.empty() || *end != '\0' || i < 0 || i >= physical) break;
    bool again = false;
    for (int s : seen) again = again || s == int(i);
    if (again) break;
    seen.push_back(int(i));
    from = to + 1;
  }
  return seen;
}

struct model_stream {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  bool busy = false;
  std::atomic<int> nccl_enqueueing{0};  // see nccl_enqueueing() in cuda_model_internal.hpp
  std::thread t;
  model_stream() {
    t = std::thread([this] {
      for (;;) {
        std::function<void()> f;
        {
          std::unique_lock l(m);
          cv.wait(l, [&] { return !q.empty(); });
          f = std::move(q.front());
          q.pop_front();
          busy = true;
        }
        if (!f) {  // cudaStreamDestroy: the stream was detached, so it owns itself now
          delete this;
          return;
        }
        f();
        {
          std::lock_guard l(m);
          busy = false;
        }
        cv.notify_all();
      }
    });
  }
  void push(std::function<void()> f) {
    // Notified under the lock: after cudaStreamDestroy's push the thread may delete the stream as soon as it can
    // take the lock, so nothing of it may be touched after the unlock.
    std::lock_guard l(m);
    q.push_back(std::move(f));
    cv.notify_all();
  }
  void sync() {
    std::unique_lock l(m);
    cv.wait(l, [&] { return q.empty() && !busy; });
  }
};

bool is_legacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread; }

// SHARDKIT_MODEL_CUDA_ASYNC_LEGACY=1: the legacy streams (all one here) queue their work on a thread; null: inline.
// Never destroyed: work may still be queued at exit.
model_stream* async_legacy() {
  static model_stream* s = [] {
    const char* v = std::getenv("SHARDKIT_MODEL_CUDA_ASYNC_LEGACY");
    return v && v[0] == '1' ? new model_stream : nullptr;
  }();
  return s;
}

// The streams created and not destroyed yet. The runtime leaves a call on a destroyed stream undefined (an error
// code at best, work on a stream created since at the same address at worst), and here the stream is freed memory:
// such a call aborts with its name, like the other misuse the model sees, so an ordinary build fails where only
// AddressSanitizer could tell before (a channel's device memory freed on its link's stream after a continuation
// had destroyed the link).
std::mutex streams_mutex;
// Never destroyed: a stream's thread still running at exit (parked work) may use it after static destructors.
std::set<const void*>& live_streams = *new std::set<const void*>;
// streams_mutex held.
model_stream* live_stream_or_abort(cudaStream_t s, const char* call) {
  if (!live_streams.count(s)) {
    std::fprintf(stderr, "cuda_nccl_model: %s on stream %p, which was destroyed (or never created)\n", call,
                 static_cast<const void*>(s));
    std::abort();
  }
  return reinterpret_cast<model_stream*>(s);
}
// streams_mutex held. The program's work on a stream NCCL is still enqueueing to (see nccl_enqueueing).
void refuse_while_nccl_enqueues(model_stream* fs, const char* call) {
  if (fs->nccl_enqueueing.load() == 0 || cuda_model::on_model_thread()) return;
  std::fprintf(stderr,
               "cuda_nccl_model: %s on stream %p while NCCL is still enqueueing a group to it (ncclGroupEnd or a "
               "collective returned ncclInProgress and the communicator's state was not polled back to ncclSuccess)\n",
               call, static_cast<const void*>(fs));
  std::abort();
}
// Waits for the stream's queue (never with streams_mutex held: the wait may be long).
void sync_stream(cudaStream_t s, const char* call) {
  if (is_legacy(s)) {
    if (auto* legacy = async_legacy()) legacy->sync();
    return;
  }
  model_stream* fs;
  {
    std::lock_guard l(streams_mutex);
    fs = live_stream_or_abort(s, call);
    refuse_while_nccl_enqueues(fs, call);
  }
  fs->sync();
}
}  // namespace

namespace cuda_model {

void run_on(cudaStream_t s, std::function<void()> f, const char* call) {
  if (is_legacy(s)) {
    if (auto* legacy = async_legacy())
      legacy->push(std::move(f));
    else
      f();
    return;
  }
  std::lock_guard l(streams_mutex);  // held while queueing: a concurrent cudaStreamDestroy cannot free it meanwhile
  auto* fs = live_stream_or_abort(s, call);
  refuse_while_nccl_enqueues(fs, call);
  fs->push(std::move(f));
}

void nccl_enqueueing(cudaStream_t s, int delta) {
  if (is_legacy(s)) return;
  std::lock_guard l(streams_mutex);
  live_stream_or_abort(s, "an NCCL launch")->nccl_enqueueing += delta;
}

namespace {

thread_local bool model_thread = false;

// NCCL's background thread, as the model plays it: a queue of jobs by due time.
class background_thread {
 public:
  static background_thread& instance() {
    static auto* b = new background_thread;  // never destroyed: jobs may still be queued at exit
    return *b;
  }
  void after_random_delay(std::function<void()> job) {
    {
      std::lock_guard l(m_);
      due_.emplace(std::chrono::steady_clock::now() + draw_delay(), std::move(job));
    }
    cv_.notify_one();
  }

 private:
  background_thread() {
    const char* v = std::getenv("SHARDKIT_MODEL_SEED");
    const unsigned long long seed = v ? std::strtoull(v, nullptr, 10) : std::random_device{}();
    rng_.seed(seed);
    std::fprintf(stderr, "cuda_nccl_model: NCCL's background jobs end after random delays, seed %llu "
                 "(SHARDKIT_MODEL_SEED=%llu draws the same delays)\n", seed, seed);
    std::thread([this] { run(); }).detach();
  }
  // Most jobs end within 150 us, one in eight takes up to 2 ms: long enough for a program that does not wait for
  // the state it must poll to run ahead of the job, short enough for suites of thousands of operations.
  std::chrono::microseconds draw_delay() {
    const bool slow = std::uniform_int_distribution<int>(0, 7)(rng_) == 0;
    return std::chrono::microseconds(slow ? std::uniform_int_distribution<int>(150, 2000)(rng_)
                                          : std::uniform_int_distribution<int>(0, 150)(rng_));
  }
  void run() {
    model_thread = true;
    std::unique_lock l(m_);
    for (;;) {
      if (due_.empty()) {
        cv_.wait(l);
        continue;
      }
      const auto when = due_.begin()->first;
      if (std::chrono::steady_clock::now() < when) {
        cv_.wait_until(l, when);
        continue;
      }
      auto job = std::move(due_.begin()->second);
      due_.erase(due_.begin());
      l.unlock();
      job();
      l.lock();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>> due_;
  std::mt19937_64 rng_;  // guarded by m_
};

}  // namespace

void after_random_delay(std::function<void()> job) { background_thread::instance().after_random_delay(std::move(job)); }
bool on_model_thread() noexcept { return model_thread; }
int current_device() noexcept { return ::current_device; }
long bus_id(int ordinal) {
  const auto seen = visible_devices();
  return ordinal >= 0 && ordinal < int(seen.size()) ? 0x18 + 0x10 * long(seen[std::size_t(ordinal)]) : -1;
}

}  // namespace cuda_model

namespace {

// What one cudaEventRecord marks: set by the stream's thread when it reaches the record; waiters sleep on it (a
// yielding spin cost seconds of system time where several ranks' threads wait on two cores).
struct event_mark {
  std::mutex m;
  std::condition_variable cv;
  bool reached = false;
  explicit event_mark(bool already) : reached(already) {}
  void set() {
    std::lock_guard l(m);
    reached = true;
    cv.notify_all();
  }
  bool is_set() {
    std::lock_guard l(m);
    return reached;
  }
  void wait() {
    std::unique_lock l(m);
    cv.wait(l, [&] { return reached; });
  }
};

struct model_event {
  std::mutex m;
  std::shared_ptr<event_mark> latest = std::make_shared<event_mark>(true);
};

// "Device" memory is host memory, so nothing would stop the backend from handing NCCL a host pointer (or
// copying the wrong way) here although a GPU would refuse it: every allocation is recorded, and NCCL calls and
// copies check that their pointers are where they must be.
std::mutex allocations_mutex;
// Never destroyed: a stream's thread still running at exit (parked work) may use it after static destructors.
std::map<const std::byte*, size_t>& allocations = *new std::map<const std::byte*, size_t>;  // start -> bytes

void* allocate_device(size_t n) {
  void* p = std::malloc(n ? n : 1);
  std::memset(p, 0xAB, n);
  std::lock_guard l(allocations_mutex);
  allocations[static_cast<const std::byte*>(p)] = n ? n : 1;
  return p;
}
void free_device(void* p) {
  {
    std::lock_guard l(allocations_mutex);
    allocations.erase(static_cast<const std::byte*>(p));
  }
  std::free(p);
}
}  // namespace

bool cuda_model::in_device_memory(const void* p, size_t n) {
  if (n == 0) return true;  // nothing is touched: NCCL and cudaMemcpy accept any pointer
  const auto* b = static_cast<const std::byte*>(p);
  std::lock_guard l(allocations_mutex);
  auto it = allocations.upper_bound(b);
  if (it == allocations.begin()) return false;
  --it;
  return b + n <= it->first + it->second;
}
namespace {
// Page-locked host memory: copies from and to it are asynchronous (cudaMemcpyAsync returns before they run).
std::mutex pinned_mutex;
// Never destroyed: a stream's thread still running at exit (parked work) may use it after static destructors.
std::map<const std::byte*, size_t>& pinned = *new std::map<const std::byte*, size_t>;  // start -> bytes
bool in_pinned_memory(const void* p, size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  std::lock_guard l(pinned_mutex);
  auto it = pinned.upper_bound(b);
  if (it == pinned.begin()) return false;
  --it;
  return b + n <= it->first + it->second;
}

}  // namespace

bool cuda_model::device_or_complain(const char* call, const char* what, const void* p, size_t n) {
  if (in_device_memory(p, n)) return true;
  std::fprintf(stderr, "cuda_nccl_model: %s: %s (%zu bytes at %p) is not in device memory\n", call, what, n, p);
  return false;
}

namespace {
// What model_hooks.hpp's cuda_call_counts reports: calls that create CUDA objects or allocate, and calls that make
// the host wait (for a stream or event, or for the whole device: cudaMemcpy, cudaFree and cudaFreeHost do).
struct call_counters {
  std::atomic<long> streams_created{0}, events_created{0}, allocations{0}, host_waits{0}, device_waits{0};
};
call_counters calls;
}  // namespace

extern "C" {
void shardkit_model_cuda_call_counts(long* out) {
  out[0] = calls.streams_created.load();
  out[1] = calls.events_created.load();
  out[2] = calls.allocations.load();
  out[3] = calls.host_waits.load();
  out[4] = calls.device_waits.load();
}

// nccl_test.cpp looks for this (a weak reference) to tell its report that these results are the model's.
const char* shardkit_cuda_model() { return "host-memory model of CUDA and NCCL (tests/nccl/cuda_nccl_model.cpp)"; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = int(visible_devices().size());
  return *count ? cudaSuccess : cudaErrorNoDevice;
}
cudaError_t cudaGetDevice(int* d) { *d = current_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) {
  const auto n = int(visible_devices().size());
  if (n == 0) return cudaErrorNoDevice;
  if (d < 0 || d >= n) return cudaErrorInvalidDevice;
  current_device = d;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char* id, int len, int d) {
  const auto n = int(visible_devices().size());
  if (n == 0) return cudaErrorNoDevice;
  if (d < 0 || d >= n) return cudaErrorInvalidDevice;
  std::snprintf(id, std::size_t(len), "00000000:%02X:00.0", unsigned(cuda_model::bus_id(d)));
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    default: return "cudaErrorModel";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return "model error";
  }
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  ++calls.streams_created;
  auto* fs = new model_stream;
  std::lock_guard l(streams_mutex);
  live_streams.insert(fs);
  *s = reinterpret_cast<cudaStream_t>(fs);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  // The stream's thread ends, and deletes the stream, once the tasks queued before run; one may be parked (a
  // collective a peer never joins), so nothing here waits for it.
  std::lock_guard l(streams_mutex);
  auto* fs = live_stream_or_abort(s, "cudaStreamDestroy");
  refuse_while_nccl_enqueues(fs, "cudaStreamDestroy");
  live_streams.erase(fs);
  fs->t.detach();
  fs->push(nullptr);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  ++calls.host_waits;
  sync_stream(s, "cudaStreamSynchronize");
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  ++calls.events_created;
  *e = reinterpret_cast<cudaEvent_t>(new model_event);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete reinterpret_cast<model_event*>(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  auto* fe = reinterpret_cast<model_event*>(e);
  auto flag = std::make_shared<event_mark>(false);
  {
    std::lock_guard l(fe->m);
    fe->latest = flag;
  }
  run_on(s, [flag] { flag->set(); });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto* fe = reinterpret_cast<model_event*>(e);
  std::lock_guard l(fe->m);
  return fe->latest->is_set() ? cudaSuccess : cudaErrorNotReady;
}
// Waits for the work the event's latest record follows (the stream's thread sets the flag once it reaches it).
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  ++calls.host_waits;
  auto* fe = reinterpret_cast<model_event*>(e);
  std::shared_ptr<event_mark> flag;
  {
    std::lock_guard l(fe->m);
    flag = fe->latest;
  }
  flag->wait();
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  auto* fe = reinterpret_cast<model_event*>(e);
  std::shared_ptr<event_mark> flag;
  {
    std::lock_guard l(fe->m);
    flag = fe->latest;
  }
  run_on(s, [flag] {
    flag->wait();
  });
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t n) {
  ++calls.allocations;
  *p = allocate_device(n);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  ++calls.device_waits;
  sync_stream(nullptr, "cudaFree");  // the runtime's cudaFree waits for the device's work, which may still read p
  if (p) free_device(p);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) { return cudaMalloc(p, n); }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) {
  ++calls.allocations;
  *p = std::malloc(n ? n : 1);
  std::memset(*p, 0xCD, n);
  std::lock_guard l(pinned_mutex);
  pinned[static_cast<const std::byte*>(*p)] = n ? n : 1;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  if (!p) return cudaSuccess;
  ++calls.device_waits;  // the runtime's cudaFreeHost waits for the device
  {
    std::lock_guard l(pinned_mutex);
    if (pinned.erase(static_cast<const std::byte*>(p)) == 0) return cudaErrorInvalidValue;
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  run_on(s, [p] { free_device(p); }, "cudaFreeAsync");
  return cudaSuccess;
}
}  // extern "C"

namespace {
// Where a copy of `kind` must find its destination and source.
bool copy_ends_ok(const char* call, void* d, const void* s, size_t n, cudaMemcpyKind k) {
  const bool d_dev = k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice;
  const bool s_dev = k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice;
  if (d_dev && !device_or_complain(call, "the destination", d, n)) return false;
  if (s_dev && !device_or_complain(call, "the source", s, n)) return false;
  return true;
}
}  // namespace

extern "C" {
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  ++calls.device_waits;
  if (!copy_ends_ok("cudaMemcpy", d, s, n, k)) return cudaErrorInvalidValue;
  sync_stream(nullptr, "cudaMemcpy");  // a legacy-stream copy: after the work queued there
  std::memcpy(d, s, n);
  return cudaSuccess;
}
// Pageable host memory follows the runtime's rules for it: a download returns once done, so it waits for
// everything queued before it on the stream (a parked collective included); an upload takes its copy of the
// source before returning and lands in stream order. Copies from or to page-locked memory (cudaHostAlloc) are
// asynchronous: they run in stream order, reading and writing the host bytes then.
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t st) {
  if (!copy_ends_ok("cudaMemcpyAsync", d, s, n, k)) return cudaErrorInvalidValue;
  if ((k == cudaMemcpyDeviceToHost && in_pinned_memory(d, n)) || (k == cudaMemcpyHostToDevice && in_pinned_memory(s, n))) {
    run_on(st, [d, s, n] { std::memcpy(d, s, n); });
    return cudaSuccess;
  }
  if (k == cudaMemcpyDeviceToHost) {
    sync_stream(st, "cudaMemcpyAsync (device to pageable host)");
    std::memcpy(d, s, n);
    return cudaSuccess;
  }
  if (k == cudaMemcpyHostToDevice) {
    auto staged = std::make_shared<std::vector<std::byte>>(static_cast<const std::byte*>(s), static_cast<const std::byte*>(s) + n);
    run_on(st, [d, staged] { std::memcpy(d, staged->data(), staged->size()); });
    return cudaSuccess;
  }
  run_on(st, [d, s, n] { std::memcpy(d, s, n); });
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t st) {
  if (!device_or_complain("cudaMemsetAsync", "the destination", d, n)) return cudaErrorInvalidValue;
  run_on(st, [d, v, n] { std::memset(d, v, n); });
  return cudaSuccess;
}

}  // extern "C"
