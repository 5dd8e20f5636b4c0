// A host-memory model of the CUDA runtime and NCCL calls the NCCL backend makes, linked into the *_model_test
// suites in place of libcudart and libnccl, so the backend's own logic (deadlines and aborts, nonblocking
// initialisation, tagged point-to-point over pair links, splits, the offsets of all_gatherv / all_to_allv,
// shutdown) runs on machines without a GPU. It models NCCL's contract as NCCL's documentation and sources state it,
// not its performance or its bugs: only a GPU run (nccl_test, scripts/gpu-check) says anything about NCCL itself.
// This file is its NCCL half; cuda_runtime_model.cpp is the CUDA runtime half (device memory, streams, events).
//
// Every NCCL operation is a stream task that rendezvouses with the other ranks (threads) and blocks its stream, as
// a kernel would, until they arrive or the communicator is aborted. Communicators are nonblocking only (the model
// refuses a blocking config), and as asynchronous as NCCL makes them: what NCCL does on its own threads completes
// here on the model's background thread after a random delay (cuda_model_internal.hpp), and the program learns of
// it only through ncclCommGetAsyncError, so a backend that does not poll as NCCL's documentation says fails here:
//  - ncclCommInitRankConfig assigns the handle at once, in state ncclInProgress, which turns ncclSuccess once every
//    rank has joined, later.
//  - ncclCommSplit returns ncclSuccess, as NCCL 2.18-2.28 do (NCCLCHECK passes the group's ncclInProgress through and
//    the function returns the child setup's result), with *newcomm null and the parent in ncclInProgress. Once all
//    ranks have called it, the background job assigns *newcomm (a child still in ncclInProgress, which turns
//    ncclSuccess later), then returns the parent to ncclSuccess. Aborting the parent meanwhile stops the job the
//    way NCCL does: *newcomm gets a child in an error state, which the program must abort too.
//  - Collectives, sends and receives (alone or between ncclGroupStart / ncclGroupEnd) return ncclInProgress and
//    put the communicator in ncclInProgress; the background job puts their tasks on the stream, then returns the
//    state to ncclSuccess. Other work on that stream before then aborts the model (NCCL forbids it).
//  - ncclCommFinalize returns ncclInProgress; the state turns ncclSuccess once the communicator's operations have
//    finished on their streams. ncclCommDestroy before then aborts the model (NCCL forbids it).
//  - Any call on a communicator still in ncclInProgress is refused with ncclInvalidArgument and a line on stderr,
//    as NCCL's ncclCommEnsureReady does; a communicator in an error state answers with that error.
//  - ncclCommInitRankConfig refuses what NCCL refuses: two ranks of one communicator on one device (the physical
//    device, after CUDA_VISIBLE_DEVICES) fail their init job with ncclInvalidUsage and ncclGetLastError's
//    "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device <bus>"; a unique id made by another process
//    fails at once (the model's NCCL spans the threads of one process; it would wait forever otherwise).
// shardkit_model_fail_next_split() (model_hooks.hpp) makes the calling thread's next split fail in its background
// job, as a bootstrap failure would: the parent's state and the child's turn ncclInternalError.
// A CUDA or NCCL call the backend starts to use must be modelled here too (the test does not link otherwise).
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
#include <string>

#include <unistd.h>
#include <tuple>
#include <utility>
#include <vector>

#include "nccl/cuda_model_internal.hpp"

using cuda_model::after_random_delay;
using cuda_model::coll_arg;
using cuda_model::compute;
using cuda_model::esize;
using cuda_model::device_or_complain;
using namespace cuda_model::coll_kinds;
using cuda_model::nccl_enqueueing;
using cuda_model::run_on;

namespace {

struct world;
struct model_comm;

// Work a group put on its way to the streams: (stream, task) pairs, settled once, by the background job (which
// queues the tasks) or by an abort (which drops them), under the communicator's `wm`.
struct launch {
  std::vector<std::pair<cudaStream_t, std::function<void()>>> tasks;
  bool settled = false;
};

// A split this rank has called and whose background job has not ended: `out` is the program's *newcomm.
struct split_request {
  ncclComm_t* out = nullptr;
  std::shared_ptr<model_comm> child;  // null for NCCL_SPLIT_NOCOLOR
  bool fail = false;                  // shardkit_model_fail_next_split()
  bool settled = false;               // guarded by the parent's wm
};

// The handle (ncclComm_t) is the raw pointer; `self` is the handle's reference, which ncclCommDestroy and
// ncclCommAbort drop, as the real ones free the communicator. Stream tasks, background jobs and an unfinished
// split hold references of their own, so a task queued or parked on the stream when the communicator is freed
// still finds it (aborted) where a GPU's kernel would find NCCL's abort flag. A handle never destroyed is a leak
// that model_hooks.hpp's count reports.
struct model_comm : std::enable_shared_from_this<model_comm> {
  std::mutex wm;  // guards w (set when a split completes), the split and the launches in flight, finalize_called
  std::shared_ptr<world> w;
  int rank = 0;
  long bus = -1;  // the PCI bus number of its device (the thread's current one at ncclCommInitRankConfig)
  std::atomic<bool> aborted{false};
  std::atomic<int> state{ncclInProgress};
  std::atomic<int> unfinished{0};  // stream tasks called for and not yet ended (finalize waits for them)
  bool finalize_called = false;
  std::shared_ptr<split_request> split;
  std::vector<std::shared_ptr<launch>> launches;
  std::uint64_t coll_seq = 0, split_seq = 0;
  std::shared_ptr<model_comm> self;
  model_comm();
  ~model_comm();
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
  std::vector<std::shared_ptr<split_request>> requests;
  std::vector<std::weak_ptr<model_comm>> parents;
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

thread_local bool fail_next_split = false;

// ncclGetLastError's text: NCCL keeps one for the process, which the last failure anywhere overwrites (so a rank
// may read a peer's failure), and so does the model.
std::mutex last_error_mutex;
std::string last_error = "";
void set_last_error(std::string text) {
  std::lock_guard l(last_error_mutex);
  last_error = std::move(text);
}

// ncclInProgress -> ncclSuccess, unless the communicator failed or was aborted meanwhile.
void settle_success(model_comm& c) {
  int expected = ncclInProgress;
  if (!c.aborted) c.state.compare_exchange_strong(expected, ncclSuccess);
}

// What NCCL's ncclCommEnsureReady answers before any use of a communicator.
ncclResult_t ready_or_refuse(model_comm* c, const char* call) {
  if (!c) return ncclInvalidArgument;
  if (c->aborted) return ncclInvalidUsage;
  const int st = c->state.load();
  if (st == ncclInProgress) {
    std::fprintf(stderr, "cuda_nccl_model: %s on a communicator whose state is still ncclInProgress (NCCL: \"Attempt to "
                 "use communicator before the previous operation returned ncclSuccess\")\n", call);
    return ncclInvalidArgument;
  }
  if (st == ncclSuccess && c->finalize_called) {
    std::fprintf(stderr, "cuda_nccl_model: %s on a communicator that was finalized\n", call);
    return ncclInvalidUsage;
  }
  return ncclResult_t(st);
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

struct pending_p2p {
  bool send;
  void* data;
  size_t bytes;
  int peer;
};
// An operation called inside a group (or alone: a group of one), in call order.
struct pending_op {
  model_comm* comm;
  cudaStream_t stream;
  bool is_coll;
  std::uint64_t seq;  // collectives: the rendezvous slot
  coll_arg coll;
  pending_p2p p2p;
};
thread_local int group_depth = 0;
thread_local std::vector<pending_op> group_ops;

void run_collective(model_comm* c, std::uint64_t seq, coll_arg a) {
  auto& w = *c->w;
  std::unique_lock l(w.m);
  auto& s = w.colls[seq];
  if (s.args.empty()) s.args.resize(w.n);
  s.args[c->rank] = a;
  if (++s.arrived == w.n) {
    compute(w.n, s.args);
    s.done = true;
    w.cv.notify_all();
  } else {
    w.cv.wait(l, [&] { return s.done || c->aborted.load(); });
  }
  if (s.done && ++s.left == w.n) w.colls.erase(seq);
}

void run_p2p_group(model_comm* c, const std::vector<pending_p2p>& ops) {
  std::vector<std::shared_ptr<std::atomic<bool>>> sent;
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

// The background job of a launch: its tasks go on their streams, then the communicator is ready again.
void complete_launch(const std::shared_ptr<model_comm>& c, const std::shared_ptr<launch>& l) {
  std::lock_guard lock(c->wm);
  if (l->settled) return;  // aborted first
  l->settled = true;
  for (auto& [stream, task] : l->tasks) {
    run_on(stream, [c, t = std::move(task)] {
      t();
      --c->unfinished;
    }, "an NCCL launch");
    nccl_enqueueing(stream, -1);
  }
  std::erase(c->launches, l);
  if (c->launches.empty()) settle_success(*c);
}

// ncclCommAbort: the launches not yet on their streams are dropped (NCCL joins its group job before it returns).
void drop_launches(model_comm& c) {
  for (auto& l : c.launches) {
    if (l->settled) continue;
    l->settled = true;
    for (auto& [stream, task] : l->tasks) {
      nccl_enqueueing(stream, -1);
      --c.unfinished;
    }
  }
  c.launches.clear();
}

// ncclGroupEnd of the outermost group: each communicator's operations become one launch. A group's point-to-point
// operations on one (communicator, stream) progress together: one task posts all the sends, then waits for the
// receives and for the sends to be taken.
ncclResult_t flush_group() {
  auto ops = std::move(group_ops);
  group_ops.clear();
  std::map<model_comm*, std::shared_ptr<launch>> launches;
  std::map<std::pair<model_comm*, cudaStream_t>, std::vector<pending_p2p>> p2p;
  for (auto& o : ops) {
    if (o.comm->aborted) return ncclInvalidUsage;
    auto& l = launches[o.comm];
    if (!l) l = std::make_shared<launch>();
    if (o.is_coll)
      l->tasks.emplace_back(o.stream, [c = o.comm->shared_from_this(), seq = o.seq, a = o.coll] { run_collective(c.get(), seq, a); });
    else
      p2p[{o.comm, o.stream}].push_back(o.p2p);
  }
  for (auto& [key, list] : p2p)
    launches[key.first]->tasks.emplace_back(key.second, [c = key.first->shared_from_this(), list] { run_p2p_group(c.get(), list); });
  for (auto& [c, l] : launches) {
    for (auto& [stream, task] : l->tasks) {
      nccl_enqueueing(stream, +1);
      ++c->unfinished;
    }
    {
      std::lock_guard lock(c->wm);
      c->launches.push_back(l);
      c->state = ncclInProgress;
    }
    after_random_delay([c = c->shared_from_this(), l] { complete_launch(c, l); });
  }
  return launches.empty() ? ncclSuccess : ncclInProgress;
}

ncclResult_t add_op(pending_op o, const char* call) {
  if (const ncclResult_t r = ready_or_refuse(o.comm, call); r != ncclSuccess) return r;
  group_ops.push_back(o);
  return group_depth == 0 ? flush_group() : ncclSuccess;
}

ncclResult_t enqueue_coll(model_comm* c, cudaStream_t stream, coll_arg a, const char* call) {
  if (const ncclResult_t r = ready_or_refuse(c, call); r != ncclSuccess) return r;
  if (!buffers_on_device(*c, a, call)) return ncclInvalidArgument;
  return add_op({c, stream, true, c->coll_seq++, a, {}}, call);
}

ncclResult_t add_p2p(model_comm* c, cudaStream_t stream, pending_p2p p, const char* call) {
  if (!device_or_complain(call, "the buffer", p.data, p.bytes)) return ncclInvalidArgument;
  return add_op({c, stream, false, 0, {}, p}, call);
}

bool nonblocking_or_complain(const ncclConfig_t* config, const char* call) {
  if (config && config->blocking == 0) return true;
  std::fprintf(stderr, "cuda_nccl_model: %s: the model has nonblocking communicators only (config.blocking = 0)\n", call);
  return false;
}

// The background job of ncclCommFinalize: done once the operations called so far have ended on their streams.
void poll_finalize(const std::weak_ptr<model_comm>& weak) {
  auto c = weak.lock();
  if (!c || c->aborted) return;
  if (c->unfinished.load() == 0) return settle_success(*c);
  after_random_delay([weak] { poll_finalize(weak); });
}

// The background job of one rank's split: *newcomm is assigned (or the failure set), then the parent is ready.
void complete_split(const std::shared_ptr<model_comm>& parent, const std::shared_ptr<split_request>& req) {
  std::lock_guard lock(parent->wm);
  if (req->settled) return;  // the parent was aborted first
  req->settled = true;
  parent->split.reset();
  if (req->fail) {
    std::fprintf(stderr, "cuda_nccl_model: ncclCommSplit fails in its background job (shardkit_model_fail_next_split)\n");
    if (req->child) {
      req->child->state = ncclInternalError;
      __atomic_store_n(req->out, reinterpret_cast<ncclComm_t>(req->child.get()), __ATOMIC_RELEASE);
    }
    parent->state = ncclInternalError;
    return;
  }
  if (req->child) {
    __atomic_store_n(req->out, reinterpret_cast<ncclComm_t>(req->child.get()), __ATOMIC_RELEASE);
    after_random_delay([child = req->child] { settle_success(*child); });
  }
  settle_success(*parent);
}

}  // namespace

extern "C" {
const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclInvalidUsage: return "invalid usage";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInProgress: return "in progress";
    case ncclInternalError: return "internal error";
    default: return "model nccl error";
  }
}
const char* ncclGetLastError(ncclComm_t) {
  thread_local std::string copy;
  std::lock_guard l(last_error_mutex);
  copy = last_error;
  return copy.c_str();
}
ncclResult_t ncclGetVersion(int* v) { *v = NCCL_VERSION_CODE; return ncclSuccess; }
// The id names the process that made it: the model's NCCL spans the threads of one process only.
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id, 0, sizeof *id);
  std::snprintf(id->internal, sizeof id->internal, "model-%ld-%d", long(::getpid()), id_counter.fetch_add(1));
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  if (!out || nranks < 1 || rank < 0 || rank >= nranks || !nonblocking_or_complain(config, "ncclCommInitRankConfig"))
    return ncclInvalidArgument;
  // Ranks as processes would wait for each other forever here (each process has its own model): refuse at once.
  if (long maker = 0; std::sscanf(id.internal, "model-%ld-", &maker) == 1 && maker != long(::getpid())) {
    set_last_error("the model's NCCL spans threads of one process: this ncclUniqueId comes from process " +
                   std::to_string(maker) + ", this is process " + std::to_string(::getpid()) +
                   " (ranks as processes need real GPUs; with the model run ranks as threads, e.g. --threads N)");
    std::fprintf(stderr, "cuda_nccl_model: ncclCommInitRankConfig: a unique id from another process\n");
    return ncclInvalidUsage;
  }
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
  c->bus = cuda_model::bus_id(cuda_model::current_device());
  *out = reinterpret_cast<ncclComm_t>(c.get());  // at once, in ncclInProgress (NCCL assigns it before its job runs)
  std::vector<std::shared_ptr<model_comm>> joined;
  {
    std::lock_guard l(w->m);
    w->members[rank] = c.get();
    if (++w->joined == w->n)
      for (auto* m : w->members)
        if (m)
          if (auto held = m->weak_from_this().lock()) joined.push_back(std::move(held));
  }
  if (!joined.empty()) {
    {
      std::lock_guard l(registry_mutex);
      if (auto it = registry.find(id.internal); it != registry.end() && it->second == w) registry.erase(it);
    }
    // Two ranks on one device: NCCL's init job fails with invalid usage on every rank ("Duplicate GPU detected"),
    // which a nonblocking communicator learns from ncclCommGetAsyncError.
    for (auto& m : joined) {
      std::string duplicate;
      for (auto& o : joined)
        if (o != m && o->bus == m->bus && duplicate.empty())
          duplicate = "Duplicate GPU detected : rank " + std::to_string(m->rank) + " and rank " + std::to_string(o->rank) +
                      " both on CUDA device " + std::to_string(m->bus);
      after_random_delay([m, duplicate] {
        if (duplicate.empty()) return settle_success(*m);
        set_last_error(duplicate);
        int expected = ncclInProgress;
        m->state.compare_exchange_strong(expected, ncclInvalidUsage);
      });
    }
  }
  return ncclInProgress;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* st) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  if (!c || !st) return ncclInvalidArgument;
  *st = ncclResult_t(c->state.load());
  return ncclSuccess;
}
}  // extern "C"

namespace {
// ncclCommDestroy and ncclCommAbort: what is still on its way to a stream is dropped, a split in progress ends
// with a failed child in *newcomm (as NCCL's abort of the parent makes the split job fail), work parked on the
// communicator gives up, and the handle's reference goes (the communicator is freed here unless a stream task, a
// job or an unfinished split still holds it).
void release(model_comm* c) {
  std::shared_ptr<world> w;
  {
    std::lock_guard l(c->wm);
    c->aborted = true;
    drop_launches(*c);
    if (auto req = std::exchange(c->split, nullptr); req && !req->settled) {
      req->settled = true;
      if (req->child) {
        req->child->state = ncclInternalError;
        __atomic_store_n(req->out, reinterpret_cast<ncclComm_t>(req->child.get()), __ATOMIC_RELEASE);
      }
    }
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
// Not NCCL's: the model's count of communicators alive, and a failure to inject (tests/nccl/model_hooks.hpp).
long shardkit_model_live_communicators() { return live_comms.load(); }
void shardkit_model_fail_next_split() { fail_next_split = true; }

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm) release(reinterpret_cast<model_comm*>(comm));
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  if (!c) return ncclSuccess;
  if (const ncclResult_t r = ready_or_refuse(c, "ncclCommFinalize"); r != ncclSuccess) return r;
  {
    std::lock_guard l(c->wm);
    c->finalize_called = true;
    c->state = ncclInProgress;
  }
  after_random_delay([weak = c->weak_from_this()] { poll_finalize(weak); });
  return ncclInProgress;
}
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  if (!c) return ncclSuccess;
  if (c->state.load() == ncclInProgress) {
    if (c->finalize_called) {
      std::fprintf(stderr, "cuda_nccl_model: ncclCommDestroy before ncclCommFinalize completed (NCCL: users should "
                   "guarantee that the state of the communicator becomes ncclSuccess before calling ncclCommDestroy)\n");
      std::abort();
    }
    return ready_or_refuse(c, "ncclCommDestroy");  // NCCL refuses it too: the communicator stays
  }
  release(c);
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* r) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  if (const ncclResult_t e = ready_or_refuse(c, "ncclCommUserRank"); e != ncclSuccess) return e;
  *r = c->rank;
  return ncclSuccess;
}
ncclResult_t ncclCommCount(const ncclComm_t comm, int* n) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  if (const ncclResult_t e = ready_or_refuse(c, "ncclCommCount"); e != ncclSuccess) return e;
  *n = c->w->n;
  return ncclSuccess;
}
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t* config) {
  auto* c = reinterpret_cast<model_comm*>(comm);
  if (!out || !nonblocking_or_complain(config, "ncclCommSplit")) return ncclInvalidArgument;
  if (const ncclResult_t r = ready_or_refuse(c, "ncclCommSplit"); r != ncclSuccess) return r;
  *out = nullptr;  // "*newcomm should be NCCL_COMM_NULL until comm split fully complete" (NCCL's init.cc)
  auto req = std::make_shared<split_request>();
  req->out = out;
  req->fail = std::exchange(fail_next_split, false);
  if (color != NCCL_SPLIT_NOCOLOR) {
    req->child = std::make_shared<model_comm>();
    req->child->self = req->child;
  }
  {
    std::lock_guard l(c->wm);
    c->split = req;
    c->state = ncclInProgress;
  }
  auto& w = *c->w;
  const auto seq = c->split_seq++;
  std::vector<std::pair<std::shared_ptr<model_comm>, std::shared_ptr<split_request>>> complete;
  {
    std::lock_guard l(w.m);
    auto& s = w.splits[seq];
    if (s.ck.empty()) {
      s.ck.resize(w.n);
      s.requests.resize(w.n);
      s.parents.resize(w.n);
    }
    s.ck[c->rank] = {color, key};
    s.requests[c->rank] = req;
    s.parents[c->rank] = c->weak_from_this();
    if (++s.arrived == w.n) {
      std::map<int, std::vector<std::tuple<int, int>>> by_color;  // color -> (key, rank)
      for (int r = 0; r < w.n; ++r)
        if (std::get<0>(s.ck[r]) != NCCL_SPLIT_NOCOLOR) by_color[std::get<0>(s.ck[r])].push_back({std::get<1>(s.ck[r]), r});
      for (auto& [col, v] : by_color) {
        std::sort(v.begin(), v.end());
        auto nw = std::make_shared<world>(int(v.size()));
        for (int i = 0; i < int(v.size()); ++i) {
          auto& m = s.requests[std::get<1>(v[i])]->child;
          {
            std::lock_guard ml(m->wm);
            m->w = nw;
            m->rank = i;
          }
          nw->members[i] = m.get();
        }
        nw->joined = nw->n;
      }
      for (int r = 0; r < w.n; ++r)
        if (auto p = s.parents[r].lock()) complete.emplace_back(std::move(p), s.requests[r]);
      w.splits.erase(seq);  // the requests (and the children's handles, or their owners' aborts) hold them now
    }
  }
  for (auto& [p, r] : complete) after_random_delay([p, r] { complete_split(p, r); });
  // NCCL 2.18-2.28 return ncclSuccess here while the split runs in the background (see the top of this file).
  return ncclSuccess;
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
  return add_p2p(reinterpret_cast<model_comm*>(c), st, {true, const_cast<void*>(s), n * esize(t), peer}, "ncclSend");
}
ncclResult_t ncclRecv(void* r, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
  return add_p2p(reinterpret_cast<model_comm*>(c), st, {false, r, n * esize(t), peer}, "ncclRecv");
}
ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return ncclInvalidUsage;
  return --group_depth == 0 ? flush_group() : ncclSuccess;
}
}  // extern "C"
