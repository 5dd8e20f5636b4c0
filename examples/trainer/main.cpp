// The example trainer: a byte-level language model (examples/trainer/model.hpp) trained with fully sharded
// parameters. The same flags on 1 and on 4 ranks train the same model on the same data: --batch is the global
// batch, split evenly over the ranks (with --data, when --batch is a multiple of the loader's 12 logical shards:
// rank 0 warns when it is not).
//
//   shardkit-run -n 4 -- trainer --steps 50                       # shm on one host, full_shard, AdamW
//   shardkit-run -n 4 -- trainer --strategy hybrid_shard --hybrid-size 2 --dtype bf16 --budget 2u
//   shardkit-run -n 4 -- trainer --steps 40 --batch 24 --ckpt-dir runs/a --ckpt-every 5 --data runs/data --init-data
//   shardkit-run -n 2 -- trainer --steps 60 --batch 24 --ckpt-dir runs/a --ckpt-every 5 --data runs/data --resume
//
// Data: by default each global row is a window of the built-in text at an offset hashed from (seed, step, row), the
// same on any number of ranks. --data LOCATION reads token files through the data loader instead (byte tokens; a
// LOCATION without token files is an error, unless --init-data: then rank 0 writes the built-in text there first,
// one document per line; the rank count must divide the loader's 12 logical shards); the loader's
// state is checkpointed with the model, so a resumed run, at any rank count, continues the same stream.
// Checkpoints: --ckpt-dir LOCATION (a directory or s3://bucket/prefix) saves every --ckpt-every steps,
// asynchronously (zero-overhead staging by default: only the next optimizer step waits for the copy); --resume
// continues from the newest complete checkpoint, on any number of ranks.
//
// Rank 0 prints one line per step: the global mean loss at full precision, tokens per second, and where the step's
// time went (compute, waiting for all-gathers, waiting for gradient reductions, gathers queued on the limiter).
// With checkpoints, it ends with their totals and the interval that keeps up on this run's link: "# checkpoint
// every K steps keeps up at this link" (with a link governor on SHARDKIT_S3_LINK: a save's bytes over what the link
// leaves idle per step, trainer/keeps_up.hpp; without one, a save's median time over a step's), and how many saves
// began before the one before had committed. Last, the CPU time of rank 0's threads by name ("# CPU on rank 0 by
// thread"): the checkpointer's sk-ckpt and its S3 sink's sk-s3 beside the trainer's own.
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <csignal>

#include "shardkit/ckpt/listing.hpp"  // list_checkpoints
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/init.hpp"  // with shardkit::tcp linked, tcp and shm+tcp too
#include "shardkit/core/link_governor.hpp"
#include "shardkit/data/loader.hpp"
#include "shardkit/data/tokenize.hpp"
#include "shardkit/fsdp/optimizer.hpp"
#include "shardkit/fsdp/sharded_model.hpp"
#include "shardkit/storage/open_sink.hpp"
#include "trainer/data.hpp"
#include "trainer/flags.hpp"
#include "trainer/keeps_up.hpp"
#include "trainer/memory.hpp"
#include "trainer/stop_signal.hpp"
#include "trainer/thread_cpu.hpp"
#include "trainer/model.hpp"
#include "trainer/trace.hpp"
#if defined(TRAINER_HAS_CUDA)
#include "shardkit/ckpt/cuda_checkpoint_device.hpp"
#include "shardkit/fsdp/cuda_gather_device.hpp"
#include "trainer/cuda_step.hpp"
#include "shardkit/backends/cuda_staged.hpp"
#endif
#include "trainer/unit_times.hpp"

namespace sk = shardkit;
namespace fsdp = shardkit::fsdp;

namespace {

using trainer::flags;
using trainer::usage;

// A unit's gathered parameters as f32 spans by name (converted when the compute dtype is not f32).
struct f32_params {
  std::vector<float> storage;
  trainer::param_map map;

  void load(const fsdp::unit_scope& u, const std::vector<trainer::param_spec>& specs) {
    map.clear();
    const sk::const_buffer_view all = u.params();
    if (all.type() == sk::dtype::f32) {
      for (const auto& s : specs) map.emplace(s.name, u.param<float>(s.name));
      return;
    }
    storage.resize(trainer::unit_numel(specs));
    sk::convert(all.type(), all.data(), sk::dtype::f32, storage.data(), storage.size());
    map = trainer::slice_unit<const float>(specs, std::span<const float>(storage));
  }
};

// Gradients written in f32; added into the unit's unsharded gradients in the reduce dtype.
struct f32_grads {
  std::vector<float> storage;
  trainer::grad_map map;
  const fsdp::unit_scope* unit = nullptr;

  void open(const fsdp::unit_scope& u, const std::vector<trainer::param_spec>& specs) {
    unit = &u;
    map.clear();
    if (u.grads().type() == sk::dtype::f32) {
      for (const auto& s : specs) map.emplace(s.name, u.grad<float>(s.name));
      return;
    }
    storage.assign(trainer::unit_numel(specs), 0.0f);
    map = trainer::slice_unit<float>(specs, std::span<float>(storage));
  }
  void close() {
    if (storage.empty() || !unit) return;
    const sk::buffer_view g = unit->grads();
    std::vector<float> cur(storage.size());
    sk::convert(g.type(), g.data(), sk::dtype::f32, cur.data(), cur.size());
    for (std::size_t i = 0; i < cur.size(); ++i) cur[i] += storage[i];
    sk::convert(sk::dtype::f32, cur.data(), g.type(), g.data(), cur.size());
    storage.clear();
  }
};

double ms(std::chrono::nanoseconds d) { return double(d.count()) / 1e6; }

// The process's peak resident set (VmHWM), in bytes: what the memory comparison of strategies reads.
std::size_t peak_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  std::size_t kib = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmHWM: %zu kB", &kib) == 1) break;
  std::fclose(f);
  return kib * 1024;
}

}  // namespace

// Set once this rank starts to join the job: from then on init_process_group reports its own refusals (and a
// process refused as a second RANK must not stop the job it was refused from).
static bool joining = false;

int main(int argc, char** argv) try {
  const flags f = trainer::parse(argc, argv);
  // --device cuda: fail here, at once and in one line, where there is no GPU (or no CUDA in this build), before
  // the ranks wait for each other. Then init_process_group's own choice of transport (shm on one host, tcp across
  // hosts, shm+tcp for both) is wrapped in backends::cuda_staged_communicator, so the gathered parameters and
  // gradients in device memory travel through pinned host memory over shardkit's transports: that is what lets N
  // ranks share one GPU (NCCL refuses two ranks on one device) and GPU traffic run over striped TCP. Each rank
  // computes on cuda:(local rank % devices); every group split from the world is staged alike.
  sk::comm::init_options init;
  int cuda_device = -1;
  if (f.cuda) {
#if defined(TRAINER_HAS_CUDA)
    init.wrap = sk::backends::cuda_staging([devices = trainer::cuda_device_count(), &cuda_device](const sk::comm::transport_setup& s) {
      cuda_device = s.hosts.local_rank(s.info.rank) % devices;
      return sk::backends::cuda_staging_options{.device = cuda_device};
    });
#else
    (void)cuda_device;
    throw std::runtime_error("--device cuda: this trainer was built without CUDA (nvcc was not found when it was configured)");
#endif
  }
  // Before any rank's checkpointer can create it: a --resume from a directory that is not there (a mistyped
  // --ckpt-dir) starts at step 0 like one without checkpoints, and the warning says which it was.
  const bool ckpt_dir_missing = f.resume && !f.ckpt_dir.empty() && !f.ckpt_dir.starts_with("s3://") &&
                                !std::filesystem::exists(f.ckpt_dir);
  joining = true;
  auto world = sk::comm::init_process_group(std::move(init));
  auto& pg = world.group;
  const int rank = pg.rank(), ranks = pg.size();
  trainer::agree_on_flags(f, pg);
  // After the ranks' first collective: every rank has started, and refuses alike (a rank leaving while the others
  // still start up would have them say only that the store closed).
  if (f.batch % (ranks * f.micro_batches) != 0)
    usage("--batch " + std::to_string(f.batch) + " must be divisible by ranks x micro-batches (" +
          std::to_string(ranks) + " x " + std::to_string(f.micro_batches) + ")");
  if (!f.ckpt_dir.empty() && !f.ckpt_dir.starts_with("s3://") && std::filesystem::exists(f.ckpt_dir) &&
      !std::filesystem::is_directory(f.ckpt_dir))
    usage("--ckpt-dir " + f.ckpt_dir + " is a file: --ckpt-dir wants a directory (one that holds checkpoints, or a "
          "new one the run creates)");
  if (f.die_rank >= ranks)
    usage("--die-rank " + std::to_string(f.die_rank) + " is not a rank of this job (0 to " + std::to_string(ranks - 1) + ", or -1 for every rank)");
  trainer::set_blas_threads(1);  // one rank per core: BLAS threads would compete with the other ranks

  std::optional<trainer::chrome_trace> trace;
  fsdp::sharding_options sharding = f.sharding;
  sharding.micro_batches = std::size_t(f.micro_batches);  // compared across ranks at construction
  // --hybrid-size 0: one shard group per host, from the hosts the ranks discovered at start (the same on each).
  if (sharding.strategy == fsdp::sharding_strategy::hybrid_shard && sharding.hybrid_shard_size == 0) {
    const int per_host = world.hosts.consecutive_ranks_per_host();
    if (per_host == 0) {
      std::string layout;
      for (int h = 0; h < world.hosts.host_count(); ++h) {
        layout += (h ? "; host " : "host ") + std::to_string(h) + ": ranks";
        for (const int r : world.hosts.ranks_on(h)) layout += " " + std::to_string(r);
      }
      usage("--hybrid-size 0 means one shard group per host, which needs as many ranks on every host, in consecutive "
            "RANKs; this job's hosts hold " + layout + ": give --hybrid-size, a count of consecutive ranks that divides " +
            std::to_string(ranks));
    }
    sharding.hybrid_shard_size = std::size_t(per_host);
  }
  // Before anything of the model is built (its per-block names and specs included): sizes beyond this host's memory
  // are refused, naming the flags, from the flags' arithmetic alone.
  const std::size_t shard = sharding.strategy == fsdp::sharding_strategy::no_shard        ? 1
                            : sharding.strategy == fsdp::sharding_strategy::hybrid_shard ? sharding.hybrid_shard_size
                                                                                          : std::size_t(ranks);
  trainer::refuse_beyond_memory(f, ranks, shard, int(world.hosts.ranks_on(world.hosts.host_of[std::size_t(rank)]).size()));
  const auto names = trainer::unit_names(f.model);
  const auto specs = trainer::unit_specs(f.model);
  std::vector<fsdp::unit_spec> units = trainer::fsdp_units(f.model);
  std::optional<trainer::unit_times> times;
  if (!f.trace.empty()) trace.emplace(rank, names);
  if (!f.plan_units.empty() && rank == 0) {
    std::vector<std::size_t> numel;
    for (const auto& s : specs) numel.push_back(trainer::unit_numel(s));
    times.emplace(f.plan_units, names, std::move(numel));  // opened now: an unwritable path fails before step 0
  }
#if defined(TRAINER_HAS_CUDA)
  if (f.cuda) sharding.device = fsdp::cuda_gather_device({.device = cuda_device});
#endif
  if (trace || times)
    sharding.on_event = [&trace, &times](const fsdp::model_event& e) {
      if (trace) trace->add(e);
      if (times) times->add(e);
    };
  // The library's budget error names its option; this program's users set it with --budget.
  fsdp::sharded_model model = [&] {
    try {
      return fsdp::sharded_model(pg, units, sharding);
    } catch (const sk::error& e) {
      // The library's option names, as this program's users set them.
      std::string what = e.what();
      bool renamed = false;
      for (const auto& [option, flag] : {std::pair<std::string, std::string>{"raise sharding_options::limiter_budget_bytes to", "give --budget"},
                                         {"hybrid_shard needs hybrid_shard_size", "--strategy hybrid_shard needs --hybrid-size"}})
        if (const auto at = what.find(option); at != std::string::npos) what.replace(at, option.size(), flag), renamed = true;
      if (renamed) throw std::runtime_error(what);
      throw;
    }
  }();
  model.init_parameters([&](const fsdp::param_slot& p, std::span<float> full) {
    trainer::init_param(trainer::param_spec{p.name, p.shape}, full, f.seed);
  });
  fsdp::adamw opt(model, {.lr = f.lr, .weight_decay = f.weight_decay});

  const std::string text = trainer::training_text();
  const int rows = f.batch / ranks / f.micro_batches, T = f.context, d = f.model.width, L = f.model.blocks;

  // The data loader, when --data is given: each rank's micro-batch is `rows` sequences of T+1 byte tokens.
  std::optional<sk::data::loader> loader;
  if (!f.data.empty()) {
    // Every rank owns as many of the loader's logical shards (docs/data.md): the rank count must divide them.
    if (const int shards = int(sk::data::loader_options{}.logical_shards); shards % ranks != 0)
      usage("--data: " + std::to_string(ranks) + " ranks do not divide the data loader's " + std::to_string(shards) +
            " logical shards (each rank owns as many): run on 1, 2, 3, 4, 6 or 12 ranks");
    auto [sink, options] = trainer::open_data(f.data, f.init_data, text, pg, rows, T, f.seed);
    loader.emplace(sink, options, pg);  // collective: every rank's options and files must agree
    trainer::refuse_context_beyond_data(*loader, T, f.data);
    // Every step takes batch / L sequences from each logical shard only when L divides the global batch; otherwise
    // which shards a step draws from depends on the rank count (docs/data.md), and so do the losses.
    const int shards = int(options.logical_shards), below = f.batch / shards * shards;
    if (pg.rank() == 0 && f.batch % shards != 0) {
      const std::string instead = (below > 0 ? std::to_string(below) + " or " : "") + std::to_string(below + shards);
      std::fprintf(stderr,
                   "trainer: warning: --batch %d is not a multiple of the data loader's %d logical shards, so this run's "
                   "batches and losses depend on the rank count; --batch %s trains the same at every rank count\n",
                   f.batch, shards, instead.c_str());
    }
  }

  // What a checkpoint holds: this rank's pieces of the parameters and of AdamW's moments (hybrid sharding: one
  // replica saves them), AdamW's step count, the step, and the data loader's state.
  std::uint64_t optimizer_steps = 0;
  std::vector<std::byte> loader_state;
  const bool saves_shards = model.replicas() <= 1 || model.replica_group().rank() == 0;
  sk::ckpt::state_dict state;
  state.add_shards(model.sharded_state(), "", saves_shards)
      .add_shards(opt.sharded_state(), "optim.", saves_shards)
      .add_value("optim.steps", optimizer_steps);
  if (loader) state.add_rank_bytes("data_loader", loader_state);
  std::optional<sk::ckpt::checkpointer> ckpt;
  if (!f.ckpt_dir.empty()) {
    // A --resume that saves nothing (no --ckpt-every) only reads: it takes no lease, so it may follow a live run.
    sk::ckpt::checkpointer_options o{.location = f.ckpt_dir, .keep_last = f.ckpt_keep, .mode = f.ckpt_mode,
                                     .seed = f.seed, .overwrite = f.overwrite, .loads_only = f.ckpt_every <= 0,
                                     .metadata = {{"model", "examples/trainer"}}};  // another model's: refused by name
#if defined(TRAINER_HAS_CUDA)
    if (f.cuda) o.device = sk::ckpt::cuda_checkpoint_device({.device = cuda_device});  // pinned staging
#endif
    ckpt.emplace(pg, sk::storage::open_sink(f.ckpt_dir), std::move(o));
  }
  // What the run computes in, recorded in every index: a resume with other dtypes says what it does (below).
  const std::map<std::string, std::string> precision_metadata{{"dtype", std::string(sk::to_string(f.sharding.precision.param))},
                                                              {"reduce_dtype", std::string(sk::to_string(f.sharding.precision.reduce))}};
  int start = 0;
  if (f.resume) {
    if (!ckpt) usage("--resume needs --ckpt-dir");
    // Strict: a checkpoint of a model with more --blocks, or saved with --data's loader state, is refused (naming
    // what no rank would load) rather than resumed from in part, as PyTorch's strict load_state_dict does.
    // A checkpoint of a run without --data holds no loader state for a resume that adds it: said so, not as a
    // missing per-rank entry.
    const auto without_loader = [&](const sk::error& e) {
      return loader && e.detail().find("has no per-rank entry 'data_loader'") != std::string::npos;
    };
    const std::string no_loader = "--data: the checkpoint in " + f.ckpt_dir + " was saved without a data loader (its run had no --data): "
                                  "resume it without --data, or start a new run with --data in another --ckpt-dir";
    // And the reverse: a checkpoint with loader state, resumed without --data, is refused by the strict load for
    // the entry no rank asks for: said as the flag, not as the load's scope.
    const auto loader_left = [&](const sk::error& e) {
      return !loader && e.detail().find("that no rank's state asks for") != std::string::npos &&
             e.detail().find("data_loader") != std::string::npos;
    };
    const std::string needs_loader = "--data: the checkpoint in " + f.ckpt_dir + " was saved with a data loader (its run had --data): "
                                     "resume it with that --data, or start a new run without --data in another --ckpt-dir";
    std::optional<sk::ckpt::load_report> resumed;
    try {
      resumed = ckpt->load_latest(state, sk::ckpt::load_scope::everything);
    } catch (const sk::error& e) {
      if (without_loader(e)) throw std::runtime_error(no_loader);
      if (loader_left(e)) throw std::runtime_error(needs_loader);
      throw;
    }
    if (auto& loaded = resumed) {
      start = int(loaded->step);
      opt.set_steps(optimizer_steps);
      if (loader) {
        std::vector<std::vector<std::byte>> saved;
        try {
          saved = ckpt->read_rank_bytes(loaded->step, "data_loader");
        } catch (const sk::error& e) {
          if (without_loader(e)) throw std::runtime_error(no_loader);
          throw;
        }
        loader->load(saved, rank, ranks);
      }
      if (rank == 0 && start >= f.steps)
        std::fprintf(stderr, "trainer: warning: --resume: the checkpoint is at step %d, not before --steps %d: nothing to train\n",
                     start, f.steps);
      if (rank == 0) {
        for (const auto& why : loaded->passed_over) std::printf("# passed over %s\n", why.c_str());
        std::printf("# resumed from step %d of %s (saved by %u rank%s, loaded by %d)\n", start, f.ckpt_dir.c_str(),
                    loaded->saved_world_size, loaded->saved_world_size == 1 ? "" : "s", ranks);
        // The checkpoint holds f32 master weights and AdamW's f32 state whatever --dtype and --reduce-dtype were
        // (they are what gathers and reductions compute in, as FSDP's MixedPrecision): a resume with others loads
        // the same tensors bit for bit, converts nothing, and computes in the new dtype from here. Said once.
        for (const auto& [key, flag, what] : {std::tuple{"dtype", "--dtype", "the parameters are gathered"},
                                              std::tuple{"reduce_dtype", "--reduce-dtype", "the gradients are reduced"}})
          if (const auto saved = std::as_const(loaded->metadata).find(key), now = precision_metadata.find(key);
              saved != loaded->metadata.cend() && saved->second != now->second)
            std::printf("# %s %s resumes a checkpoint saved with %s %s: its %zu tensors on rank 0 load as saved, in f32 "
                        "(master weights and AdamW state: nothing converted); %s in %s from here (%s -> %s at each step, "
                        "as in a %s run), so the losses leave the %s run's\n",
                        flag, now->second.c_str(), flag, saved->second.c_str(), loaded->tensors_loaded, what,
                        now->second.c_str(), saved->second.c_str(), now->second.c_str(), now->second.c_str(),
                        saved->second.c_str());
      }
    } else {
      // load_latest throws when indexes exist and none loads; an index that appeared since it looked is refused here
      // all the same: starting over at step 0 would train from scratch on a --resume and overwrite it with its own
      // saves. No index at all (a new location, or a first save that never committed) is a fresh start.
      auto sink = sk::storage::open_sink(f.ckpt_dir);
      const auto listed = sk::ckpt::list_checkpoints(sink, "");
      if (!listed.indexed.empty()) {
        std::string steps;
        for (auto s : listed.indexed) steps += (steps.empty() ? "" : ", ") + std::to_string(s);
        throw std::runtime_error("--resume: no checkpoint in " + f.ckpt_dir + " loads, though step(s) " + steps +
                                 " have an index (shardkit-ckpt ls " + f.ckpt_dir + " says why); not starting over "
                                 "at step 0 on top of them: repair them, or move them away to start anew");
      }
      // PyTorch's resume-if-present: a fresh start, said loudly (a mistyped path must not pass for a new run).
      std::string missing = ckpt_dir_missing ? " (" + f.ckpt_dir + " did not exist: a mistyped --ckpt-dir?)" : "";
      // S3 has no directories: a prefix under which nothing exists is the mistyped one.
      if (rank == 0 && f.ckpt_dir.starts_with("s3://") && sink.list("").empty()) {
        const auto bucket = f.ckpt_dir.substr(0, f.ckpt_dir.find('/', 5) == std::string::npos ? f.ckpt_dir.size() : f.ckpt_dir.find('/', 5));
        missing = " (nothing exists under " + f.ckpt_dir + ": a mistyped --ckpt-dir? `aws s3 ls " + bucket +
                  "/` lists the bucket's prefixes)";
      }
      if (rank == 0)
        std::fprintf(stderr, "trainer: warning: --resume: no checkpoint found under %s; starting at step 0%s\n",
                     f.ckpt_dir.c_str(), missing.c_str());
    }
  }
  // A run that saves opens its location now: another run's checkpoints there (no --resume) or a live writer are
  // refused before the first step, not at the first save.
  // From here a signal stops the run after a step (stop_signal.hpp); before, nothing of the run's needs ending.
  trainer::catch_stop_signals();
  if (ckpt && f.ckpt_every > 0) ckpt->open_for_saves();
  std::vector<sk::basic_completion<sk::ckpt::save_result>> saves;
  double ckpt_stall_ms = 0, total_ckpt_stall_ms = 0;
  std::vector<double> step_ms;  // every step's time, for the checkpoint summary's sustainable interval
  // The governor of the link checkpoints share with training (SHARDKIT_S3_LINK): the collectives' bytes it counts
  // per step give the link's idle time, hence the interval that keeps up (trainer/keeps_up.hpp).
  const char* shared_link = std::getenv("SHARDKIT_S3_LINK");
  sk::link_governor* link = ckpt && shared_link && *shared_link ? sk::governor_for_link(shared_link) : nullptr;
  const auto collectives_tx = [&] { return link ? link->sent(sk::link_direction::tx, sk::traffic_class::collectives) : 0; };
  const std::uint64_t tx_before = collectives_tx();
  std::vector<std::uint64_t> tx_after_step;
  std::size_t saves_behind = 0;  // saves requested while the one before had not committed: the checkpointer fell behind
  const std::size_t act = std::size_t(rows) * T * d;
  std::vector<std::vector<float>> acts(std::size_t(L) + 2, std::vector<float>(act));  // acts[k]: input of unit k
  std::vector<float> grad_in(act), grad_out(act);
  trainer::embed_cache embed_cache;
  std::vector<trainer::block_cache> block_caches(static_cast<std::size_t>(L));
  trainer::head_cache head_cache;
  f32_params params;
  f32_grads grads;

  if (rank == 0)
    std::printf("# trainer: %d rank%s over %s, %s, params %s, grads %s, %zu units, limiter budget %zu bytes, "
                "global batch %d x %d tokens\n",
                ranks, ranks == 1 ? "" : "s", world.transport.c_str(),
                (std::string(fsdp::to_string(f.sharding.strategy)) +
                 (sharding.strategy == fsdp::sharding_strategy::hybrid_shard
                      ? " (shard groups of " + std::to_string(sharding.hybrid_shard_size) + " ranks)"
                      : std::string()))
                    .c_str(),
                std::string(sk::to_string(f.sharding.precision.param)).c_str(),
                std::string(sk::to_string(f.sharding.precision.reduce)).c_str(), units.size(),
                model.limiter().budget(), f.batch, T);
#if defined(TRAINER_HAS_CUDA)
  std::optional<trainer::cuda_steps> gpu;
  if (f.cuda) gpu.emplace(f.model, cuda_device, act);
  if (rank == 0 && gpu)
    std::printf("# device: cuda:%d, gathered parameters, gradients and activations on the GPU (f32), master shards "
                "and AdamW on the host, collectives staged through pinned memory over %s\n",
                cuda_device, world.transport.c_str());
  if (rank == 0) std::printf("# blas: %s\n", gpu ? gpu->blas_description().c_str() : trainer::blas_description().c_str());
#else
  if (rank == 0) std::printf("# blas: %s\n", trainer::blas_description().c_str());
#endif

  int stopped_by = 0;  // SIGINT, SIGTERM or SIGHUP, agreed on by every rank: the exit status is 128 + it
  for (int step = start; step < f.steps; ++step) {
    if (step == f.die_at_step && (f.die_rank < 0 || f.die_rank == rank)) std::raise(SIGKILL);
    model.reset_stats();
    const auto t0 = std::chrono::steady_clock::now();
    double loss = 0;
    for (int m = 0; m < f.micro_batches; ++m) {
      const int first = rank * (f.batch / ranks) + m * rows;
      const trainer::batch b = loader ? trainer::next_batch(*loader, rows, T)
                                      : trainer::make_batch(text, f.batch, T, std::uint64_t(step), f.seed, first, rows);
#if defined(TRAINER_HAS_CUDA)
      if (gpu && !f.skip_compute) {
        loss += gpu->micro_batch(model, specs, b, m + 1 == f.micro_batches, 1.0f / float(f.micro_batches)) / f.micro_batches;
        continue;
      }
#endif
      for (auto& u : model.forward()) {
        if (f.skip_compute) continue;
        params.load(u, specs[u.index()]);
        const std::size_t k = u.index();
        if (k == 0)
          trainer::embed_forward(f.model, params.map, b, acts[1], embed_cache);
        else if (k <= std::size_t(L))
          trainer::block_forward(f.model, int(k) - 1, params.map, rows, T, acts[k], acts[k + 1], block_caches[k - 1]);
        else
          loss += trainer::head_forward(f.model, params.map, b, acts[k], head_cache) / f.micro_batches;
      }
      for (auto& u : model.backward(m + 1 == f.micro_batches)) {
        if (f.skip_compute) continue;
        params.load(u, specs[u.index()]);
        grads.open(u, specs[u.index()]);
        const std::size_t k = u.index();
        if (k == std::size_t(L) + 1) {
          trainer::head_backward(f.model, params.map, head_cache, grad_in, grads.map, 1.0f / float(f.micro_batches));
        } else if (k >= 1) {
          trainer::block_backward(f.model, int(k) - 1, params.map, block_caches[k - 1], grad_in, grad_out, grads.map);
          std::swap(grad_in, grad_out);
        } else {
          trainer::embed_backward(f.model, embed_cache, grad_in, grads.map);
        }
        grads.close();
      }
    }
    // The loss's mean and whether any rank got a stop signal, in one all-reduce (stop_signal.hpp).
    const auto [global_loss, stop_signal, got_stop_signal_here] = trainer::agree_on_step(pg, loss);
    if (f.clip > 0) model.clip_grad_norm(f.clip);
    if (ckpt) ckpt_stall_ms = 1e3 * ckpt->wait_staged();  // the last checkpoint's copy, before parameters change
    opt.step();
    model.zero_grad();
    if (ckpt && f.ckpt_every > 0 && (step + 1) % f.ckpt_every == 0) {
      optimizer_steps = opt.steps();
      if (loader) loader_state = loader->state();
      const auto c0 = std::chrono::steady_clock::now();
      saves_behind += !saves.empty() && !saves.back().is_done();
      saves.push_back(ckpt->save(std::uint64_t(step + 1), state, precision_metadata));
      if (f.ckpt_blocking) saves.back().wait();  // a synchronous save: persisted and committed before training goes on
      ckpt_stall_ms += ms(std::chrono::steady_clock::now() - c0);
    }
    const auto elapsed = std::chrono::steady_clock::now() - t0;
    step_ms.push_back(ms(elapsed));
    tx_after_step.push_back(collectives_tx());
    if (trace) trace->step(step, t0, t0 + elapsed);
    if (times) {
      const auto st = model.stats();
      times->step(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed),
                  st.waiting_for_gather + st.waiting_for_reduce);
    }
    if (rank == 0) {
      const auto st = model.stats();
      const auto waiting = st.waiting_for_gather + st.waiting_for_reduce;
      // The groups' own scratch: peak_gathered_bytes + it stays within a --budget in bytes (in units, the scratch
      // comes on top); "unknown" where a backend cannot tell (NCCL).
      const std::string scratch = st.group_scratch_known ? std::to_string(st.group_scratch_bytes) : "unknown";
      std::printf("step %d loss %.9g tokens/s %.0f step_ms %.2f compute_ms %.2f gather_wait_ms %.2f "
                  "reduce_wait_ms %.2f limiter_wait_ms %.2f ckpt_stall_ms %.3f data_wait_ms %.3f peak_gathered_bytes %zu "
                  "group_scratch_bytes %s peak_rss_bytes %zu\n",
                  step, global_loss, double(f.batch) * T / std::chrono::duration<double>(elapsed).count(),
                  ms(elapsed), ms(std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed) - waiting),
                  ms(st.waiting_for_gather), ms(st.waiting_for_reduce), ms(st.limiter.waited), ckpt_stall_ms,
                  loader ? 1e3 * loader->stats().wait_seconds : 0.0, st.limiter.peak_bytes, scratch.c_str(),
                  peak_rss_bytes());
      std::fflush(stdout);
    }
    total_ckpt_stall_ms += ckpt_stall_ms;
    ckpt_stall_ms = 0;
    if ((stopped_by = stop_signal) != 0) {  // every rank after this same step (stop_signal.hpp)
      if (rank == 0)
        std::fprintf(stderr, "trainer: %s: stopping after step %d%s\n", trainer::signal_name(stopped_by), step,
                     ckpt ? ", once the save in flight has ended; the checkpoint location's lease is then released" : "");
      else if (!got_stop_signal_here)  // ranks started by hand, one of them signalled: the others say why they stop
        std::fprintf(stderr, "trainer: rank %d: another rank got %s: stopping with it after step %d\n", rank,
                     trainer::signal_name(stopped_by), step);
      break;
    }
  }
  if (trace) trace->write(f.trace);
  if (times)
    times->write("examples/trainer --width " + std::to_string(d) + " --blocks " + std::to_string(L) + " --context " +
                     std::to_string(T) + ", " + std::to_string(rows) + " rows per rank and micro-batch, " +
                     std::to_string(ranks) + " rank(s)",
                 int(model.shard_size()));
  if (times) std::printf("# plan units: wrote %s\n", f.plan_units.c_str());
  if (ckpt) {
    ckpt->wait();
    std::size_t committed = 0;
    double stage_ms = 0, persist_ms = 0, commit_ms = 0;
    std::vector<double> save_ms;  // stage + persist + commit of each save: how long it kept the checkpointer busy
    for (auto& c : saves) {
      const auto& r = c.get();
      committed += r.committed;
      stage_ms += 1e3 * r.stage_seconds, persist_ms += 1e3 * r.persist_seconds, commit_ms += 1e3 * r.commit_seconds;
      save_ms.push_back(1e3 * (r.stage_seconds + r.persist_seconds + r.commit_seconds));
    }
    if (rank == 0 && !saves.empty()) {
      const double n = double(saves.size());
      std::printf("# checkpoints: %zu of %zu committed in %s, training stalled %.3f ms in all; per save on rank 0: "
                  "stage %.3f ms, persist %.3f ms, commit %.3f ms\n",
                  committed, saves.size(), f.ckpt_dir.c_str(), total_ckpt_stall_ms, stage_ms / n, persist_ms / n, commit_ms / n);
      std::vector<double> save_bytes;
      for (auto& c : saves) save_bytes.push_back(double(c.get().bytes_written));
      const auto k = trainer::sustainable_interval(step_ms, tx_after_step, tx_before, save_bytes, save_ms,
                                                   link ? double(link->options().bytes_per_second) : 0.0,
                                                   link ? link->options().floor_percent : 0);
      std::printf("# checkpoint every %ld steps keeps up at this link (%s); "
                  "every %d: %zu of %zu saves began before the one before had committed\n",
                  k.every, k.why.c_str(), f.ckpt_every, saves_behind, saves.size());
    }
  }
  if (rank == 0) {  // what the saves cost in CPU (sk-ckpt, sk-s3), beside training: by thread name, while they live
    std::string by_thread;
    for (const auto& [name, cpu_ms] : trainer::cpu_ms_by_thread_name())
      by_thread += (by_thread.empty() ? "" : ", ") + name + " " + std::to_string(std::lround(cpu_ms));
    std::printf("# CPU on rank 0 by thread (ms, the run's whole): %s\n", by_thread.c_str());
  }
  return stopped_by ? 128 + stopped_by : 0;  // the checkpointer, destroyed on the way out, releases its lease
} catch (const std::exception& e) {
  std::fprintf(stderr, "trainer: %s\n", e.what());
  // Failed before it began to join the job (no --device cuda here): rank 0 says so at once.
  if (!joining) sk::rendezvous::report_failure_to_store(std::string("trainer: ") + e.what());
  return 1;
}
