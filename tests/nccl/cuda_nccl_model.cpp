// A host-memory model of the CUDA runtime and NCCL calls the NCCL backend makes, linked into nccl_model_test in
// place of libcudart and libnccl, so the backend's own logic (deadlines and aborts, nonblocking initialisation,
// tagged point-to-point over pair links, splits, the offsets of all_gatherv / all_to_allv, shutdown) runs on
// machines without a GPU. It models NCCL's contract, not its performance or its bugs: only a GPU run
// (nccl_test, scripts/gpu-check) says anything about NCCL itself.
//
// The model: "device" memory is host memory, but recorded, and NCCL calls and copies refuse pointers on the
// wrong side (as a GPU would), so host buffers handed to NCCL fail here too; page-locked host memory (cudaHostAlloc)
// is recorded as well, and copies to and from it run asynchronously in stream order as on a GPU, so a missing
// synchronisation reads stale bytes here too; each stream is a thread running its queue in order (the legacy
// stream runs work inline); events are flags set by the stream; every NCCL operation is a stream task that
// rendezvouses with the other ranks (threads) and blocks its stream, as a kernel would, until they arrive or the
// communicator is aborted. Nonblocking communicators report ncclInProgress until every rank has joined.
// SHARDKIT_MODEL_CUDA_DEVICES sets the device count (default 4). A CUDA or NCCL call the backend starts to use
// must be modelled here too (the test does not link otherwise).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "shardkit/core/reduce_op.hpp"

namespace {

thread_local int current_device = 0;

struct model_stream {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  bool busy = false;
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
// Waits for the stream's queue (never with streams_mutex held: the wait may be long).
void sync_stream(cudaStream_t s, const char* call) {
  if (is_legacy(s)) return;
  model_stream* fs;
  {
    std::lock_guard l(streams_mutex);
    fs = live_stream_or_abort(s, call);
  }
  fs->sync();
}
void run_on(cudaStream_t s, std::function<void()> f, const char* call = "a stream-ordered call") {
  if (is_legacy(s)) {
    f();
    return;
  }
  std::lock_guard l(streams_mutex);  // held while queueing: a concurrent cudaStreamDestroy cannot free it meanwhile
  live_stream_or_abort(s, call)->push(std::move(f));
}

struct model_event {
  std::mutex m;
  std::shared_ptr<std::atomic<bool>> latest = std::make_shared<std::atomic<bool>>(true);
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
bool in_device_memory(const void* p, size_t n) {
  if (n == 0) return true;  // nothing is touched: NCCL and cudaMemcpy accept any pointer
  const auto* b = static_cast<const std::byte*>(p);
  std::lock_guard l(allocations_mutex);
  auto it = allocations.upper_bound(b);
  if (it == allocations.begin()) return false;
  --it;
  return b + n <= it->first + it->second;
}
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

bool device_or_complain(const char* call, const char* what, const void* p, size_t n) {
  if (in_device_memory(p, n)) return true;
  std::fprintf(stderr, "cuda_nccl_model: %s: %s (%zu bytes at %p) is not in device memory\n", call, what, n, p);
  return false;
}

// ---- NCCL ----
struct world;
// The handle (ncclComm_t) is the raw pointer; `self` is the handle's reference, which ncclCommDestroy and
// ncclCommAbort drop, as the real ones free the communicator. Stream tasks and an unfinished split hold references
// of their own, so a task queued or parked on the stream when the communicator is freed still finds it (aborted)
// where a GPU's kernel would find NCCL's abort flag. A handle never destroyed is a leak LeakSanitizer reports.
struct model_comm : std::enable_shared_from_this<model_comm> {
  std::mutex wm;  // guards w while a split child waits for its world (set when the last parent rank arrives)
  std::shared_ptr<world> w;
  int rank = 0;
  std::atomic<bool> aborted{false};
  std::atomic<int> state{ncclInProgress};
  std::uint64_t coll_seq = 0, split_seq = 0;
  std::shared_ptr<model_comm> self;
  model_comm();
  ~model_comm();
};

struct coll_arg {
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t dt;
  ncclRedOp_t op;
  int root;
  int kind;
};
struct coll_slot {
  std::vector<coll_arg> args;
  int arrived = 0, left = 0;  // the slot is erased when every rank has seen it done
  bool done = false;
};
struct p2p_msg {
  const void* data;
  size_t bytes;
  std::shared_ptr<std::atomic<bool>> taken;
};
struct split_slot {
  std::vector<std::tuple<int, int>> ck;  // color, key per parent rank
  std::vector<std::shared_ptr<model_comm>> out;
  int arrived = 0;
};

// Owned by its communicators (model_comm::w); members point back without owning (a freed communicator clears
// its entry).
struct world {
  int n;
  std::mutex m;
  std::condition_variable cv;
  std::vector<model_comm*> members;
  int joined = 0;
  std::map<std::uint64_t, coll_slot> colls;
  std::map<std::pair<int, int>, std::deque<p2p_msg>> p2p;
  std::map<std::uint64_t, split_slot> splits;
  explicit world(int n_) : n(n_), members(n_, nullptr) {}
};

std::atomic<long> live_comms{0};  // what shardkit_model_live_communicators() reports

model_comm::model_comm() { ++live_comms; }
model_comm::~model_comm() {
  --live_comms;
  if (!w) return;  // a split child freed before its split completed never joined a world
  std::lock_guard l(w->m);
  if (w->members[rank] == this) w->members[rank] = nullptr;
}

// Worlds being initialised, by unique id; erased once every rank has joined (its communicators own it then).
std::mutex registry_mutex;
std::map<std::string, std::shared_ptr<world>> registry;
std::atomic<int> id_counter{0};

thread_local int group_depth = 0;
struct pending_p2p {
  bool send;
  void* data;
  size_t bytes;
  int peer;
  model_comm* comm;
  cudaStream_t stream;
};
thread_local std::vector<pending_p2p> group_ops;

shardkit::dtype to_shardkit(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return shardkit::dtype::f32;
    case ncclFloat64: return shardkit::dtype::f64;
    case ncclFloat16: return shardkit::dtype::f16;
    case ncclBfloat16: return shardkit::dtype::bf16;
    case ncclInt32: return shardkit::dtype::i32;
    case ncclInt64: return shardkit::dtype::i64;
    default: return shardkit::dtype::u8;
  }
}
shardkit::reduce_op to_shardkit(ncclRedOp_t op) {
  switch (op) {
    case ncclSum: return shardkit::reduce_op::sum;
    case ncclProd: return shardkit::reduce_op::prod;
    case ncclMin: return shardkit::reduce_op::min;
    case ncclMax: return shardkit::reduce_op::max;
    default: return shardkit::reduce_op::avg;
  }
}
size_t esize(ncclDataType_t t) { return shardkit::size_of(to_shardkit(t)); }

enum { k_allreduce, k_allgather, k_reducescatter, k_bcast, k_reduce };

void compute(world& w, coll_slot& s) {
  const auto& a0 = s.args[0];
  for (const auto& a : s.args)  // NCCL would compute garbage or hang; here a disagreement is a loud failure
    if (a.kind != a0.kind || a.count != a0.count || a.dt != a0.dt || a.op != a0.op || a.root != a0.root) {
      std::fprintf(stderr, "cuda_nccl_model: ranks called collective #%d with different arguments\n", a0.kind);
      std::abort();
    }
  const size_t es = esize(a0.dt);
  const auto dt = to_shardkit(a0.dt);
  const auto op = to_shardkit(a0.op);
  auto reduce_all = [&](size_t count) {
    std::vector<std::byte> acc(count * es);
    std::memcpy(acc.data(), s.args[0].send, count * es);
    for (int r = 1; r < w.n; ++r) shardkit::combine(op, dt, acc.data(), s.args[r].send, count);
    shardkit::finish_average(op, dt, acc.data(), count, w.n);
    return acc;
  };
  switch (a0.kind) {
    case k_allreduce: {
      auto acc = reduce_all(a0.count);
      for (auto& a : s.args) std::memcpy(a.recv, acc.data(), acc.size());
      break;
    }
    case k_allgather: {
      std::vector<std::byte> all(a0.count * es * w.n);
      for (int r = 0; r < w.n; ++r) std::memcpy(all.data() + r * a0.count * es, s.args[r].send, a0.count * es);
      for (auto& a : s.args) std::memcpy(a.recv, all.data(), all.size());
      break;
    }
    case k_reducescatter: {
      auto acc = reduce_all(a0.count * w.n);
      for (int r = 0; r < w.n; ++r) std::memcpy(s.args[r].recv, acc.data() + r * a0.count * es, a0.count * es);
      break;
    }
    case k_bcast: {
      std::vector<std::byte> d(a0.count * es);
      std::memcpy(d.data(), s.args[a0.root].send, d.size());
      for (auto& a : s.args) std::memcpy(a.recv, d.data(), d.size());
      break;
    }
    case k_reduce: {
      auto acc = reduce_all(a0.count);
      std::memcpy(s.args[a0.root].recv, acc.data(), acc.size());
      break;
    }
  }
}

// The bytes of a collective's send and receive buffers this rank must own in device memory, as NCCL reads them
// (a broadcast reads its send buffer and a reduce writes its receive buffer on the root only).
bool buffers_on_device(const model_comm& c, const coll_arg& a, const char* call) {
  const size_t bytes = a.count * esize(a.dt), all = bytes * size_t(c.w->n);
  const bool root = c.rank == a.root;
  size_t send = bytes, recv = bytes;
  switch (a.kind) {
    case k_allgather: recv = all; break;
    case k_reducescatter: send = all; break;
    case k_bcast: send = root ? bytes : 0; break;
    case k_reduce: recv = root ? bytes : 0; break;
  }
  return device_or_complain(call, "the send buffer", a.send, send) && device_or_complain(call, "the receive buffer", a.recv, recv);
}

ncclResult_t enqueue_coll(model_comm* c, cudaStream_t stream, coll_arg a, const char* call) {
  if (!c || c->aborted) return ncclInvalidUsage;
  if (!buffers_on_device(*c, a, call)) return ncclInvalidArgument;
  const auto seq = c->coll_seq++;
  run_on(stream, [c = c->shared_from_this(), seq, a] {
    auto& w = *c->w;
    std::unique_lock l(w.m);
    auto& s = w.colls[seq];
    if (s.args.empty()) s.args.resize(w.n);
    s.args[c->rank] = a;
    if (++s.arrived == w.n) {
      compute(w, s);
      s.done = true;
      w.cv.notify_all();
    } else {
      w.cv.wait(l, [&] { return s.done || c->aborted.load(); });
    }
    if (s.done && ++s.left == w.n) w.colls.erase(seq);
  });
  return ncclSuccess;
}

void run_p2p_group(std::vector<pending_p2p> ops) {
  std::vector<std::shared_ptr<std::atomic<bool>>> sent;
  auto* c = ops[0].comm;
  auto& w = *c->w;
  {
    std::lock_guard l(w.m);
    for (auto& o : ops)
      if (o.send) {
        auto flag = std::make_shared<std::atomic<bool>>(false);
        w.p2p[{c->rank, o.peer}].push_back({o.data, o.bytes, flag});
        sent.push_back(flag);
      }
  }
  w.cv.notify_all();
  std::unique_lock l(w.m);
  for (auto& o : ops) {
    if (o.send) continue;
    auto& q = w.p2p[{o.peer, c->rank}];
    w.cv.wait(l, [&] { return !q.empty() || c->aborted.load(); });
    if (c->aborted) return;
    auto msg = q.front();
    q.pop_front();
    if (msg.bytes != o.bytes) {  // real NCCL would truncate or hang; the backend's headers must prevent this
      std::fprintf(stderr, "cuda_nccl_model: ncclSend of %zu bytes met ncclRecv of %zu\n", msg.bytes, o.bytes);
      std::abort();
    }
    std::memcpy(o.data, msg.data, o.bytes);
    msg.taken->store(true);
    w.cv.notify_all();
  }
  for (auto& f : sent) w.cv.wait(l, [&] { return f->load() || c->aborted.load(); });
}

ncclResult_t flush_group() {
  // A group's operations progress together: one stream task per (communicator, stream) posts all its sends,
  // then waits for its receives and for its sends to be taken.
  std::map<std::pair<model_comm*, cudaStream_t>, std::vector<pending_p2p>> by;
  for (auto& o : group_ops) by[{o.comm, o.stream}].push_back(o);
  group_ops.clear();
  for (auto& [k, ops] : by) {
    if (k.first->aborted) return ncclInvalidUsage;
    run_on(k.second, [keep = k.first->shared_from_this(), ops] { run_p2p_group(ops); });
  }
  return ncclSuccess;
}

ncclResult_t add_p2p(pending_p2p o) {
  if (!o.comm || o.comm->aborted) return ncclInvalidUsage;
  if (!device_or_complain(o.send ? "ncclSend" : "ncclRecv", "the buffer", o.data, o.bytes)) return ncclInvalidArgument;
  group_ops.push_back(o);
  if (group_depth == 0) return flush_group();
  return ncclSuccess;
}

}  // namespace

extern "C" {
// nccl_test.cpp looks for this (a weak reference) to tell its report that these results are the model's.
const char* shardkit_cuda_model() { return "host-memory model of CUDA and NCCL (tests/nccl/cuda_nccl_model.cpp)"; }

cudaError_t cudaGetDeviceCount(int* count) {
  const char* v = std::getenv("SHARDKIT_MODEL_CUDA_DEVICES");
  *count = v ? std::atoi(v) : 4;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) { *d = current_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { current_device = d; return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorModel"; }
const char* cudaGetErrorString(cudaError_t) { return "model error"; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
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
  live_streams.erase(fs);
  fs->t.detach();
  fs->push(nullptr);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  sync_stream(s, "cudaStreamSynchronize");
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(new model_event);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { delete reinterpret_cast<model_event*>(e); return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  auto* fe = reinterpret_cast<model_event*>(e);
  auto flag = std::make_shared<std::atomic<bool>>(false);
  {
    std::lock_guard l(fe->m);
    fe->latest = flag;
  }
  run_on(s, [flag] { flag->store(true); });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  auto* fe = reinterpret_cast<model_event*>(e);
  std::lock_guard l(fe->m);
  return fe->latest->load() ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  auto* fe = reinterpret_cast<model_event*>(e);
  std::shared_ptr<std::atomic<bool>> flag;
  {
    std::lock_guard l(fe->m);
    flag = fe->latest;
  }
  run_on(s, [flag] {
    while (!flag->load()) std::this_thread::yield();
  });
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t n) { *p = allocate_device(n); return cudaSuccess; }
cudaError_t cudaFree(void* p) {
  if (p) free_device(p);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) { return cudaMalloc(p, n); }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) {
  *p = std::malloc(n ? n : 1);
  std::memset(*p, 0xCD, n);
  std::lock_guard l(pinned_mutex);
  pinned[static_cast<const std::byte*>(*p)] = n ? n : 1;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  if (!p) return cudaSuccess;
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
  if (!copy_ends_ok("cudaMemcpy", d, s, n, k)) return cudaErrorInvalidValue;
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

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclInvalidUsage: return "invalid usage";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInProgress: return "in progress";
    default: return "model nccl error";
  }
}
const char* ncclGetLastError(ncclComm_t) { return "model last error"; }
ncclResult_t ncclGetVersion(int* v) { *v = NCCL_VERSION_CODE; return ncclSuccess; }
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  std::snprintf(id->internal, sizeof id->internal, "model-%d", id_counter.fetch_add(1));
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank, ncclConfig_t*) {
  std::shared_ptr<world> w;
  {
    std::lock_guard l(registry_mutex);
    auto& slot = registry[id.internal];
    if (!slot) slot = std::make_shared<world>(nranks);
    w = slot;
  }
  auto c = std::make_shared<model_comm>();
  c->self = c;
  c->w = w;
  c->rank = rank;
  *out = reinterpret_cast<ncclComm_t>(c.get());
  bool complete = false;
  {
    std::lock_guard l(w->m);
    w->members[rank] = c.get();
    if (++w->joined == w->n) {
      complete = true;
      for (auto* m : w->members)
        if (m) m->state = ncclSuccess;
    }
  }
  if (complete) {
    std::lock_guard l(registry_mutex);
    if (auto it = registry.find(id.internal); it != registry.end() && it->second == w) registry.erase(it);
  }
  return ncclInProgress;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* st) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  if (!c) return ncclInvalidArgument;
  *st = ncclResult_t(c->state.load());
  return ncclSuccess;
}
}  // extern "C"

namespace {
// ncclCommDestroy and ncclCommAbort: work parked on the communicator gives up, and the handle's reference goes
// (the communicator is freed here unless a stream task or an unfinished split still holds it).
void release(model_comm* c) {
  c->aborted = true;
  std::shared_ptr<world> w;
  {
    std::lock_guard l(c->wm);
    w = c->w;
  }
  if (w) {
    { std::lock_guard l(w->m); }  // a waiter between its check of `aborted` and its wait cannot miss the notify
    w->cv.notify_all();
  }
  auto handle = std::move(c->self);
}
}  // namespace

extern "C" {
// Not NCCL's: the model's count of communicators alive (tests/nccl/model_hooks.hpp).
long shardkit_model_live_communicators() { return live_comms.load(); }

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm) release(reinterpret_cast<model_comm*>(comm));
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  release(reinterpret_cast<model_comm*>(comm));
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* r) { *r = reinterpret_cast<model_comm*>(comm)->rank; return ncclSuccess; }
ncclResult_t ncclCommCount(const ncclComm_t comm, int* n) { *n = reinterpret_cast<model_comm*>(comm)->w->n; return ncclSuccess; }
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t*) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  auto& w = *c->w;
  const auto seq = c->split_seq++;
  std::shared_ptr<model_comm> mine;
  if (color != NCCL_SPLIT_NOCOLOR) {
    mine = std::make_shared<model_comm>();
    mine->self = mine;
  }
  *out = reinterpret_cast<ncclComm_t>(mine.get());
  std::lock_guard l(w.m);
  auto& s = w.splits[seq];
  if (s.ck.empty()) {
    s.ck.resize(w.n);
    s.out.resize(w.n);
  }
  s.ck[c->rank] = {color, key};
  s.out[c->rank] = mine;
  if (++s.arrived == w.n) {
    std::map<int, std::vector<std::tuple<int, int>>> by_color;  // color -> (key, rank)
    for (int r = 0; r < w.n; ++r)
      if (std::get<0>(s.ck[r]) != NCCL_SPLIT_NOCOLOR) by_color[std::get<0>(s.ck[r])].push_back({std::get<1>(s.ck[r]), r});
    for (auto& [col, v] : by_color) {
      std::sort(v.begin(), v.end());
      auto nw = std::make_shared<world>(int(v.size()));
      for (int i = 0; i < int(v.size()); ++i) {
        auto& m = s.out[std::get<1>(v[i])];
        {
          std::lock_guard ml(m->wm);
          m->w = nw;
          m->rank = i;
        }
        nw->members[i] = m.get();
      }
      nw->joined = nw->n;
      for (auto* m : nw->members) m->state = ncclSuccess;
    }
    w.splits.erase(seq);  // the children's handles (or their owners' aborts) hold them now
  }
  return ncclInProgress;
}
ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
  return enqueue_coll(reinterpret_cast<model_comm*>(c), st, {s, r, n, t, op, 0, k_allreduce}, "ncclAllReduce");
}
ncclResult_t ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t st) {
  return enqueue_coll(reinterpret_cast<model_comm*>(c), st, {s, r, n, t, ncclSum, 0, k_allgather}, "ncclAllGather");
}
ncclResult_t ncclReduceScatter(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
  return enqueue_coll(reinterpret_cast<model_comm*>(c), st, {s, r, n, t, op, 0, k_reducescatter}, "ncclReduceScatter");
}
ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t t, int root, ncclComm_t c, cudaStream_t st) {
  return enqueue_coll(reinterpret_cast<model_comm*>(c), st, {s, r, n, t, ncclSum, root, k_bcast}, "ncclBroadcast");
}
ncclResult_t ncclReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, int root, ncclComm_t c, cudaStream_t st) {
  return enqueue_coll(reinterpret_cast<model_comm*>(c), st, {s, r, n, t, op, root, k_reduce}, "ncclReduce");
}
ncclResult_t ncclSend(const void* s, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
  return add_p2p({true, const_cast<void*>(s), n * esize(t), peer, reinterpret_cast<model_comm*>(c), st});
}
ncclResult_t ncclRecv(void* r, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
  return add_p2p({false, r, n * esize(t), peer, reinterpret_cast<model_comm*>(c), st});
}
ncclResult_t ncclGroupStart() { ++group_depth; return ncclSuccess; }
ncclResult_t ncclGroupEnd() {
  if (--group_depth == 0) {
    const auto r = flush_group();
    return r == ncclSuccess ? ncclInProgress : r;  // nonblocking comms report the group in progress
  }
  return ncclSuccess;
}
}
