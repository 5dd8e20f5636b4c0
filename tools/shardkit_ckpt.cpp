// shardkit-ckpt: lists, verifies, inspects and consolidates the checkpoints shardkit::ckpt::checkpointer writes.
//
//   shardkit-ckpt ls LOCATION [--json]
//   shardkit-ckpt verify LOCATION [--step N]
//   shardkit-ckpt inspect LOCATION [--step N] [--json]
//   shardkit-ckpt consolidate LOCATION --out DIR [--step N] [--max-shard-size 5GB] [--all] [--force]
//   shardkit-ckpt gc LOCATION [--min-age SECONDS] [--damaged] [--ignore-lease [--force]]
//
// LOCATION is what the checkpointer was given: a directory, or s3://bucket/prefix where storage/open_sink.hpp and
// the S3 sink are built in. Without --step a command takes the newest complete checkpoint (the one a resume
// loads). Progress bars go to stderr when it is a terminal or with --progress (--no-progress: never). Exit
// status: 0 fine, 1 a problem (verify found one, or an error), 2 a usage error. The format is specified in
// docs/checkpoint-format.md.
#include <charconv>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include "ckpt_common.hpp"
#include "ckpt_consolidate.hpp"
#include "ckpt_verify.hpp"

namespace {

using namespace ckpt_cli;

int usage(std::FILE* to = stderr) {
  std::fputs(
      "usage: shardkit-ckpt ls LOCATION [--json]\n"
      "       shardkit-ckpt verify LOCATION [--step N]\n"
      "       shardkit-ckpt inspect LOCATION [--step N] [--json]\n"
      "       shardkit-ckpt consolidate LOCATION --out DIR [--step N] [--max-shard-size 5GB] [--all] [--force]\n"
      "       shardkit-ckpt gc LOCATION [--min-age SECONDS] [--damaged] [--ignore-lease [--force]]\n"
      "LOCATION: a checkpoint directory (or s3://bucket/prefix); without --step, the latest complete checkpoint.\n"
      "  --progress / --no-progress  progress bars on stderr (default: when stderr is a terminal)\n"
      "  --json                      ls, inspect: one JSON document on stdout (exact bytes, every piece's file)\n"
      "  --out DIR                   consolidate: where model.safetensors (or model-0000i-of-0000N.safetensors and\n"
      "                              model.safetensors.index.json) go\n"
      "  --max-shard-size SIZE       consolidate: largest output file's data, e.g. 5GB (10^9), 500MiB (2^20), bytes\n"
      "  --all                       consolidate: also per-rank entries (rank/...) and optimizer state (optim.*)\n"
      "  --force                     consolidate: replace a consolidated model already in DIR; gc: with --ignore-lease,\n"
      "                              also a holder whose pid is alive on this host\n"
      "gc removes debris: the objects of steps without an index older than the latest complete checkpoint, writers'\n"
      "temporaries in those steps, and the other temporaries unmodified for --min-age SECONDS (default 600; 0 once no\n"
      "run writes there). On s3:// the temporaries are pending multipart uploads (ListMultipartUploads), aborted; their\n"
      "age is that of their newest part. A storage probe (probe-<seconds>-<id>.json) that a checkpointer killed at its\n"
      "construction left is such a temporary, as old as its name says. While a live run holds the location's lease (lease.json, judged as a resume's\n"
      "takeover judges it), gc keeps that run's save in progress (newer steps, their temporaries) and refuses\n"
      "--min-age, naming the run; --ignore-lease treats that lease as dead (a run you know died on another host less\n"
      "than its expiry ago), but is refused, naming the pid, while the holder's process is alive on this host (same\n"
      "host name and pid namespace): --ignore-lease --force for a pid that another process reused. With --damaged it\n"
      "also removes the damaged checkpoints a resume moved aside (step-N.damaged/: ls lists them; without --damaged gc\n"
      "keeps them). A lease.json that is not an object (a directory) is reported as a damaged lease, never removed.\n"
      "ls: complete means the index parses and every file it lists is there with the size it records (verify also\n"
      "checks every checksum); latest is the newest complete step, the one a resume loads first; in-progress, the\n"
      "steps and temporaries of the save of a live run that holds the lease.\n",
      to);
  return to == stdout ? 0 : 2;
}

// A table printed with each column as wide as its widest cell; the last column is not padded.
void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width;
  for (const auto& row : rows)
    for (std::size_t c = 0; c < row.size(); ++c) {
      if (width.size() <= c) width.resize(c + 1, 0);
      width[c] = std::max(width[c], row[c].size());
    }
  for (const auto& row : rows) {
    std::string line;
    for (std::size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  }
}

std::string metadata_text(const std::map<std::string, std::string>& metadata) {
  std::string out;
  for (const auto& [k, v] : metadata) out += (out.empty() ? "" : " ") + k + "=" + v;
  return out;
}

// What ls says of one step.
struct step_info {
  std::uint64_t step = 0;
  std::string status;  // complete, damaged, bad-index, debris
  bool latest = false;
  std::string moved_aside;  // a damaged checkpoint a resume moved aside: its prefix (step-N.damaged/)
  std::optional<std::uint32_t> world_size;
  std::size_t files = 0;  // the index's files, or the objects of a step without a (parsable) index
  std::uint64_t bytes = 0;
  std::optional<std::size_t> tensors;
  std::map<std::string, std::string> metadata;
  std::vector<std::string> problems;
};

// Every step under the location: complete (an index that parses and every file it lists present, with the size it
// records), damaged (an index whose files are not all there or not of their size, or a checkpoint a resume moved
// aside), bad index, or debris (objects without an index). Latest: the newest complete one.
std::vector<step_info> list_steps(st::any_sink& sink) {
  const auto listed = ck::list_checkpoints(sink, "");
  std::vector<step_info> out;
  for (const auto& [step, keys] : listed.keys_by_step) {
    step_info info{.step = step};
    const std::set<std::string> present(keys.begin(), keys.end());
    std::optional<ck::checkpoint_index> index;
    if (listed.indexed.contains(step)) try {
        index = ck::read_index(sink, "", step);
        if (index) index = relative_to_location(std::move(*index));
        if (!index) info.problems.push_back("its index vanished while listing");
      } catch (const std::exception& e) {
        info.problems.push_back(message_of(e));
      }
    if (!index) {
      info.status = listed.indexed.contains(step) ? "bad-index" : "debris";
      info.files = keys.size();
      for (const auto& k : keys) info.bytes += sink.size(k).value_or(0);
      out.push_back(std::move(info));
      continue;
    }
    info.bytes = step_bytes(sink, *index);
    for (const auto& f : index->files) {
      if (!present.contains(f.key)) info.problems.push_back(f.key + " is listed in its index but absent");
      else if (const auto n = sink.size(f.key); n && *n != f.size)
        info.problems.push_back(f.key + " holds " + std::to_string(*n) + " bytes, its index says " + std::to_string(f.size));
    }
    info.status = info.problems.empty() ? "complete" : "damaged";
    info.world_size = index->world_size;
    info.files = index->files.size();
    info.tensors = index->tensors.size();  // as inspect lists them and verify counts them
    info.metadata = index->metadata;
    out.push_back(std::move(info));
  }
  for (const auto& [aside, d] : listed.damaged) {
    step_info info{.step = d.step, .status = "damaged", .moved_aside = aside, .files = d.keys.size()};
    for (const auto& k : d.keys) info.bytes += sink.size(k).value_or(0);
    info.problems.push_back("moved aside to " + aside + " by a resume that could not load it (nothing deleted; gc --damaged removes it)");
    out.push_back(std::move(info));
  }
  std::stable_sort(out.begin(), out.end(), [](const step_info& a, const step_info& b) { return a.step < b.step; });
  for (auto it = out.rbegin(); it != out.rend(); ++it)
    if (it->status == "complete") {
      it->latest = true;
      break;
    }
  return out;
}

// What a sink's temporaries are at `location`: an S3 sink's are pending multipart uploads.
const char* temporary_noun(const std::string& location) {
  return location.starts_with("s3://") ? "pending multipart upload" : "temporary file";
}

// Whether the live save of the lease's holder may be writing what lies in `step` (none: not a step's): a step newer
// than the latest complete one (saves run in step order), or the latest itself (a writer's temporary of it may still
// be renamed away). Without a live lease nothing is.
bool of_live_save(const lease_state& lease, std::optional<std::uint64_t> step, std::optional<std::uint64_t> latest) {
  return lease.live() && !(step && latest && *step < *latest);
}

// The storage probes at the location (ck::location_probe_key): checkpointers killed at their construction left them,
// or a live construction reads its own for a few seconds. LIST shows them, outside every step.
std::vector<std::string> location_probes(st::any_sink& sink) {
  std::vector<std::string> out;
  for (auto& k : sink.list(std::string(ck::location_probe_stem)))
    if (k.find('/') == std::string::npos && ck::detail::is_location_probe_key(k)) out.push_back(std::move(k));
  return out;
}

// What the lease says, for ls and gc: empty without one.
std::string lease_line(const lease_state& lease) {
  if (!lease.record) return {};
  if (lease.live()) return "in progress: " + lease.holder_text();
  return "lease: " + lease.holder_text() + (lease.record->unparsed.empty() ? "; no run writes here (the next run takes it over)" : "");
}

int run_ls(const common_options& o) {
  auto sink = open_location(o.location, false);
  const auto lease = read_location_lease(sink, o.location);
  auto steps = list_steps(sink);
  std::size_t complete = 0, damaged = 0;
  std::optional<std::uint64_t> latest;
  for (const auto& s : steps)
    if (s.latest) latest = s.step;
  // Debris: objects of steps without an index, and writers' temporaries (LIST never shows them); while a live run
  // holds the lease, those its save may be writing are its save in progress instead.
  struct tally {
    std::size_t objects = 0, temporaries = 0, probes = 0;
    std::uint64_t bytes = 0, temporary_bytes = 0, probe_bytes = 0;
  } debris, in_progress;
  for (auto& s : steps) {
    complete += s.status == "complete";
    damaged += s.status == "damaged" || s.status == "bad-index";
    if (s.status != "debris") continue;
    if (of_live_save(lease, s.step, latest)) s.status = "in-progress";
    auto& t = s.status == "debris" ? debris : in_progress;
    t.objects += s.files, t.bytes += s.bytes;
  }
  for (const auto& t : sink.temporaries("")) {
    auto& into = of_live_save(lease, ck::detail::step_of_key(t.key, ""), latest) ? in_progress : debris;
    ++into.temporaries, into.temporary_bytes += t.bytes;
  }
  // Probes lie in no step: a temporary outside a step's rule (the live run's, else debris).
  for (const auto& k : location_probes(sink)) {
    auto& into = of_live_save(lease, std::nullopt, latest) ? in_progress : debris;
    ++into.probes, into.probe_bytes += sink.size(k).value_or(0);
  }
  auto probes_text = [](const tally& t, const char* whose) {
    return t.probes ? ", " + plural(t.probes, "storage probe") + " (" + human_bytes(t.probe_bytes) + ") " + whose : std::string{};
  };
  if (o.json) {
    nlohmann::ordered_json j = {{"location", o.location}, {"latest", nullptr}, {"steps", nlohmann::ordered_json::array()}};
    if (latest) j["latest"] = *latest;
    for (const auto& s : steps) {
      nlohmann::ordered_json e = {{"step", s.step}, {"status", s.status}, {"latest", s.latest}, {"world_size", nullptr},
                                  {"files", s.files}, {"bytes", s.bytes}, {"tensors", nullptr}, {"metadata", s.metadata},
                                  {"problems", s.problems}};
      if (s.world_size) e["world_size"] = *s.world_size;
      if (s.tensors) e["tensors"] = *s.tensors;
      e["moved_aside"] = s.moved_aside.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(s.moved_aside);
      j["steps"].push_back(std::move(e));
    }
    auto tally_json = [](const tally& t) {
      return nlohmann::ordered_json{{"objects", t.objects},         {"bytes", t.bytes},   {"temporaries", t.temporaries},
                                    {"temporary_bytes", t.temporary_bytes}, {"probes", t.probes}, {"probe_bytes", t.probe_bytes}};
    };
    j["debris"] = tally_json(debris);
    j["in_progress"] = tally_json(in_progress);
    j["lease"] = nullptr;
    if (lease.record) {
      const auto& l = *lease.record;
      j["lease"] = l.unparsed.empty() ? nlohmann::ordered_json{{"run", l.run}, {"host", l.host}, {"pid", l.pid},
                                                               {"renewed_seconds_ago", lease.now - l.renewed},
                                                               {"expiry", lease.expiry.count()}}
                                      : nlohmann::ordered_json{{"unparsed", l.unparsed}};
      j["lease"]["live"] = lease.live();
      j["lease"]["stale_reason"] = lease.stale_reason;
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s: %s, %s%s%s\n", o.location.c_str(), plural(steps.size(), "step").c_str(),
              plural(complete, "complete checkpoint").c_str(), damaged ? (", " + std::to_string(damaged) + " damaged").c_str() : "",
              latest ? (", latest step " + std::to_string(*latest)).c_str() : "");
  std::vector<std::vector<std::string>> rows{{"step", "status", "latest", "world", "files", "size", "tensors", "metadata"}};
  for (const auto& s : steps)
    rows.push_back({std::to_string(s.step), s.status, s.latest ? "latest" : "", s.world_size ? std::to_string(*s.world_size) : "-",
                    std::to_string(s.files), human_bytes(s.bytes), s.tensors ? std::to_string(*s.tensors) : "-",
                    s.status == "debris"        ? "(no index: a save that did not commit)"
                    : s.status == "in-progress" ? "(no index yet: the live run's save)"
                    : !s.moved_aside.empty()    ? "(moved aside: " + s.moved_aside + ")"
                                                : metadata_text(s.metadata)});
  if (rows.size() > 1) print_table(rows);
  for (const auto& s : steps)
    for (const auto& p : s.problems) std::printf("note: step %llu: %s\n", static_cast<unsigned long long>(s.step), p.c_str());
  if (const auto line = lease_line(lease); !line.empty()) {
    std::string save;
    if (in_progress.objects || in_progress.temporaries || in_progress.probes)
      save = "; its save in progress: " + plural(in_progress.objects, "object") + " (" + human_bytes(in_progress.bytes) +
             ") of steps without an index yet, " + plural(in_progress.temporaries, temporary_noun(o.location)) + " (" +
             human_bytes(in_progress.temporary_bytes) + ")" + probes_text(in_progress, "of checkpointers' constructions");
    std::printf("%s%s\n", line.c_str(), save.c_str());
  }
  if (debris.objects || debris.temporaries || debris.probes)
    std::printf("debris: %s (%s) of steps without an index, %s (%s) that killed writers left%s; shardkit-ckpt gc removes it\n",
                plural(debris.objects, "object").c_str(), human_bytes(debris.bytes).c_str(),
                plural(debris.temporaries, temporary_noun(o.location)).c_str(), human_bytes(debris.temporary_bytes).c_str(),
                probes_text(debris, "that checkpointers killed at their construction left").c_str());
  return 0;
}

// Whether `out` is the checkpoint location or under it: as paths (resolved, symlinks too), or as s3:// strings.
bool out_inside_location(const std::string& location, const std::string& out) {
  if (location.starts_with("s3://") || out.starts_with("s3://")) {
    auto with_slash = [](std::string s) { return s.ends_with('/') ? s : s + "/"; };
    return with_slash(out).starts_with(with_slash(location));
  }
  std::error_code ec;
  const auto loc = std::filesystem::weakly_canonical(location, ec);
  const auto dest = std::filesystem::weakly_canonical(out, ec);
  if (ec) return false;
  const auto [l, d] = std::mismatch(loc.begin(), loc.end(), dest.begin(), dest.end());
  return l == loc.end() || (std::next(l) == loc.end() && l->empty());  // every component of the location matched
}

// What gc is asked: --min-age (given or the default), --damaged, --ignore-lease.
struct gc_options {
  std::chrono::seconds min_age{600};
  bool min_age_given = false;
  bool damaged = false;
  bool ignore_lease = false;
  bool force = false;  // with ignore_lease: even when the holder's pid is alive on this host
};

// Removes debris that no live save can be writing: steps without an index older than the latest complete checkpoint
// (saves run in step order, so none writes there) with their temporaries, and other temporaries older than min_age,
// unless a live run holds the location's lease: then those are its save's, and kept (an explicit --min-age is
// refused, naming the run, unless --ignore-lease).
int run_gc(const common_options& o, const gc_options& g) {
  auto sink = open_location(o.location, false);
  auto lease = read_location_lease(sink, o.location);
  const bool ignored = lease.live() && g.ignore_lease;
  if (ignored && !g.force && ck::holder_alive_here(*lease.record, ck::detail::host_name()))
    sk::throw_error(sk::errc::config,
                    "--ignore-lease refused: " + lease.holder_text() + ", and its process, pid " +
                        std::to_string(lease.record->pid) + " on this host, is alive: gc would remove its save in "
                        "progress. Stop that run (its lease is stale once pid " + std::to_string(lease.record->pid) +
                        " is gone) and gc again, or add --force if pid " + std::to_string(lease.record->pid) +
                        " is another process now",
                    {.operation = "shardkit-ckpt gc", .object = o.location});
  if (ignored) {
    std::printf("%s: --ignore-lease: treating the lease as dead: %s\n", o.location.c_str(), lease.holder_text().c_str());
    lease.stale_reason = "--ignore-lease";
  }
  if (lease.live() && g.min_age_given)
    sk::throw_error(sk::errc::config,
                    o.location + " is in use: " + lease.holder_text() + "; it expires " + std::to_string(lease.expiry.count()) +
                        " s after a renewal. gc --min-age removes temporaries by age, and that run's save in progress "
                        "writes them. Run gc without --min-age (it keeps what a live save may write), wait for that run "
                        "to end, or pass --ignore-lease if you know it is dead",
                    {.operation = "shardkit-ckpt gc", .object = o.location});
  const auto listed = ck::list_checkpoints(sink, "");
  const auto latest = ck::latest_checkpoint(sink, "");
  const std::optional<std::uint64_t> latest_step = latest ? std::optional(latest->step) : std::nullopt;
  std::vector<std::string> keys;
  std::uint64_t bytes = 0, temporary_bytes = 0, kept_bytes = 0;
  std::size_t steps = 0, removed_temporaries = 0, kept_temporaries = 0;
  for (const auto& [step, step_keys] : listed.keys_by_step) {
    if (listed.indexed.contains(step) || !latest || step >= latest->step) continue;
    ++steps;
    for (const auto& k : step_keys) keys.push_back(k), bytes += sink.size(k).value_or(0);
  }
  sink.remove_many(keys);
  const auto now = std::chrono::system_clock::now();
  std::map<std::string, std::chrono::seconds> sweeps;  // a directory's key prefix, and the age its sweep takes
  for (const auto& t : sink.temporaries("")) {
    const auto step = ck::detail::step_of_key(t.key, "");
    if (of_live_save(lease, step, latest_step)) {
      ++kept_temporaries, kept_bytes += t.bytes;
      continue;
    }
    const bool old_step = step && latest && *step < latest->step;
    if (!old_step && now - t.modified < g.min_age) continue;
    sweeps.emplace(t.key.substr(0, t.key.rfind('/') + 1), old_step ? std::chrono::seconds(0) : g.min_age);
    ++removed_temporaries, temporary_bytes += t.bytes;
  }
  for (const auto& [dir, age] : sweeps) sink.remove_stale_temporaries(age, dir);
  // Storage probes, as temporaries outside a step: a live construction holds no lease yet and reads its own probe for
  // a few seconds, which --min-age (600 s by default) leaves it. Their age is their name's (the writer's clock).
  std::vector<std::string> probes;
  std::size_t kept_probes = 0;
  std::uint64_t probe_bytes = 0;
  for (auto& k : location_probes(sink)) {
    if (of_live_save(lease, std::nullopt, latest_step) ||
        ck::detail::unix_seconds() - *ck::detail::location_probe_written(k) < g.min_age.count()) {
      ++kept_probes;
      continue;
    }
    probe_bytes += sink.size(k).value_or(0);
    probes.push_back(std::move(k));
  }
  sink.remove_many(probes);
  // Damaged checkpoints moved aside: kept unless asked (someone may want to look at them), and listed either way.
  std::vector<std::string> aside;
  std::uint64_t aside_bytes = 0;
  for (const auto& [prefix, d] : listed.damaged)
    for (const auto& k : d.keys) aside.push_back(k), aside_bytes += sink.size(k).value_or(0);
  if (g.damaged) sink.remove_many(aside);
  std::printf("%s: removed %s (%s) of %s without an index, %s (%s)\n", o.location.c_str(), plural(keys.size(), "object").c_str(),
              human_bytes(bytes).c_str(), plural(steps, "step").c_str(), plural(removed_temporaries, temporary_noun(o.location)).c_str(),
              human_bytes(temporary_bytes).c_str());
  if (!probes.empty())
    std::printf("removed %s (%s) that checkpointers killed at their construction left\n", plural(probes.size(), "storage probe").c_str(),
                human_bytes(probe_bytes).c_str());
  if (kept_probes)
    std::printf("kept %s: %s\n", plural(kept_probes, "storage probe").c_str(),
                lease.live() ? "the live run's"
                             : ("younger than --min-age (" + std::to_string(g.min_age.count()) +
                                " s), a checkpointer's construction may be reading it").c_str());
  if (lease.live())
    std::printf("kept the save in progress: %s; %s (%s) and the objects of newer steps without an index are its own\n",
                lease.holder_text().c_str(), plural(kept_temporaries, temporary_noun(o.location)).c_str(),
                human_bytes(kept_bytes).c_str());
  else if (const auto line = lease_line(lease); !line.empty() && !ignored)
    std::printf("%s\n", line.c_str());
  if (!listed.damaged.empty()) {
    std::string names;
    for (const auto& [prefix, d] : listed.damaged) names += " " + prefix;
    std::printf("%s %s (%s) moved aside:%s%s\n", g.damaged ? "removed" : "kept", plural(listed.damaged.size(), "damaged checkpoint").c_str(),
                human_bytes(aside_bytes).c_str(), names.c_str(), g.damaged ? "" : "; --damaged removes them");
  }
  return 0;
}

int run_verify(const common_options& o) {
  auto sink = open_location(o.location, false);
  const auto index = choose_checkpoint(sink, o);
  std::printf("verifying step %llu of %s: world size %u, %s, %s\n", static_cast<unsigned long long>(index.step),
              o.location.c_str(), index.world_size, plural(index.files.size(), "file").c_str(),
              human_bytes(step_bytes(sink, index)).c_str());
  const auto summary = verify_checkpoint(sink, index, o.progress, stdout);
  for (const auto& p : summary.problems) std::printf("error: %s\n", p.c_str());
  std::printf("step %llu: %s, %s in %s checked: %s\n", static_cast<unsigned long long>(index.step),
              plural(summary.files, "file").c_str(), plural(summary.tensors, "tensor").c_str(),
              plural(summary.pieces, "piece").c_str(),
              summary.problems.empty() ? "OK" : plural(summary.problems.size(), "problem").c_str());
  return summary.problems.empty() ? 0 : 1;
}

int run_inspect(const common_options& o) {
  auto sink = open_location(o.location, false);
  const auto index = choose_checkpoint(sink, o);
  const std::uint64_t bytes = step_bytes(sink, index);
  const ck::load_plan plan(index);
  std::map<const ck::index_file*, std::uint32_t> rank;
  for (std::size_t p = 0; p < index.files.size(); ++p) rank[&index.files[p]] = rank_of_file(index, p);
  if (o.json) {
    nlohmann::ordered_json j = {{"location", o.location}, {"step", index.step}, {"world_size", index.world_size},
                                {"files", index.files.size()}, {"bytes", bytes}, {"metadata", index.metadata},
                                {"tensors", nlohmann::ordered_json::array()}};
    for (const auto& name : tensor_names(index)) {
      const auto pieces = plan.pieces(name);
      const ck::index_tensor& t = *pieces.front().tensor;
      nlohmann::ordered_json e = {{"name", name}, {"dtype", ck::safetensors_dtype(t.type)}, {"global_shape", t.global_shape},
                                  {"pieces", nlohmann::ordered_json::array()}};
      for (const auto& p : pieces)
        e["pieces"].push_back({{"rank", rank[p.file]}, {"file", p.file->key}, {"begin", p.piece->begin}, {"end", p.piece->end},
                               {"data_offsets", {p.piece->data_begin, p.piece->data_end}}});
      j["tensors"].push_back(std::move(e));
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("step %llu of %s: world size %u, %s, %s%s%s\n", static_cast<unsigned long long>(index.step), o.location.c_str(),
              index.world_size, plural(index.files.size(), "file").c_str(), human_bytes(bytes).c_str(),
              index.metadata.empty() ? "" : ", metadata: ", metadata_text(index.metadata).c_str());
  std::vector<std::vector<std::string>> rows{{"name", "dtype", "shape", "size", "pieces"}};
  for (const auto& name : tensor_names(index)) {
    const auto pieces = plan.pieces(name);
    const ck::index_tensor& t = *pieces.front().tensor;
    std::uint64_t numel = 1;
    for (auto d : t.global_shape) numel *= d;
    std::string ranges = std::to_string(pieces.size()) + ":";
    for (const auto& p : pieces) ranges += " r" + std::to_string(rank[p.file]) + " " + range_text(p.piece->begin, p.piece->end);
    rows.push_back({name, std::string(ck::safetensors_dtype(t.type)), shape_text(t.global_shape),
                    human_bytes(numel * sk::size_of(t.type)), ranges});
  }
  print_table(rows);
  std::printf("%s; pieces are elements [begin, end) of the flattened tensor, rN the rank whose file holds them\n",
              plural(rows.size() - 1, "tensor").c_str());
  return 0;
}

int run_consolidate(const common_options& o, const consolidate_options& c) {
  auto sink = open_location(o.location, false);
  const auto index = choose_checkpoint(sink, o);
  const auto summary = consolidate_checkpoint(sink, o.location, index, c, o.progress);
  std::printf("consolidated step %llu of %s into %s: %s, %s in %s\n", static_cast<unsigned long long>(index.step),
              o.location.c_str(), c.out.c_str(), plural(summary.tensors, "tensor").c_str(), human_bytes(summary.total_size).c_str(),
              plural(summary.files.size(), "file").c_str());
  for (const auto& [key, size] : summary.files) std::printf("  %s  %s\n", key.c_str(), human_bytes(size).c_str());
  if (summary.excluded_rank_entries || summary.excluded_optimizer)
    std::printf("left out %zu per-rank entries (rank/...) and %zu optimizer tensors (optim.*); --all includes them\n",
                summary.excluded_rank_entries, summary.excluded_optimizer);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string_view command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") return usage(stdout);
  if (command != "ls" && command != "verify" && command != "inspect" && command != "consolidate" && command != "gc") {
    std::fprintf(stderr, "shardkit-ckpt: unknown command '%s'\n", argv[1]);
    return usage();
  }
  common_options o;
  o.progress = ::isatty(STDERR_FILENO) == 1;
  consolidate_options c;
  bool out_given = false;
  gc_options gc;
  for (int i = 2; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&](std::string_view name) -> std::optional<std::string> {
      if (i + 1 < argc) return std::string(argv[++i]);
      std::fprintf(stderr, "shardkit-ckpt: %s needs a value\n", std::string(name).c_str());
      return std::nullopt;
    };
    if (a == "-h" || a == "--help") return usage(stdout);
    if (a == "--progress") o.progress = true;
    else if (a == "--json" && (command == "ls" || command == "inspect")) o.json = true;
    else if (a == "--no-progress") o.progress = false;
    else if (a == "--step" && command != "ls" && command != "gc") {
      const auto v = value(a);
      std::uint64_t step = 0;
      if (!v) return usage();
      auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), step);
      if (ec != std::errc{} || end != v->data() + v->size()) {
        std::fprintf(stderr, "shardkit-ckpt: --step takes a step number, not '%s'\n", v->c_str());
        return 2;
      }
      o.step = step;
    } else if (a == "--out" && command == "consolidate") {
      const auto v = value(a);
      if (!v) return usage();
      c.out = *v;
      out_given = true;
    } else if (a == "--max-shard-size" && command == "consolidate") {
      const auto v = value(a);
      if (!v) return usage();
      const auto size = parse_size(*v);
      if (!size || *size == 0) {
        std::fprintf(stderr, "shardkit-ckpt: --max-shard-size takes a size such as 5GB, 500MiB or 1000000, not '%s'\n", v->c_str());
        return 2;
      }
      c.max_shard_size = *size;
    } else if (a == "--min-age" && command == "gc") {
      const auto v = value(a);
      if (!v) return usage();
      long long n = -1;
      auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
      if (ec != std::errc{} || end != v->data() + v->size() || n < 0) {
        std::fprintf(stderr, "shardkit-ckpt: --min-age takes whole seconds (0 or more), not '%s'\n", v->c_str());
        return 2;
      }
      gc.min_age = std::chrono::seconds(n);
      gc.min_age_given = true;
    } else if (a == "--damaged" && command == "gc") gc.damaged = true;
    else if (a == "--ignore-lease" && command == "gc") gc.ignore_lease = true;
    else if (a == "--force" && command == "gc") gc.force = true;
    else if (a == "--all" && command == "consolidate") c.all = true;
    else if (a == "--force" && command == "consolidate") c.force = true;
    else if (!a.starts_with("-") && o.location.empty()) o.location = a;
    else {
      std::fprintf(stderr, "shardkit-ckpt %s: unexpected argument '%s'\n", argv[1], argv[i]);
      return usage();
    }
  }
  if (o.location.empty()) {
    std::fprintf(stderr, "shardkit-ckpt %s: no LOCATION\n", argv[1]);
    return usage();
  }
  if (command == "gc" && gc.force && !gc.ignore_lease) {
    std::fprintf(stderr, "shardkit-ckpt gc: --force goes with --ignore-lease (it ignores a lease whose holder's pid is alive here)\n");
    return usage();
  }
  if (command == "consolidate" && !out_given) {
    std::fprintf(stderr, "shardkit-ckpt consolidate: --out DIR is required\n");
    return usage();
  }
  if (command == "consolidate" && out_inside_location(o.location, c.out)) {
    // Retention (or gc) would delete what it wrote, and ls would list it as debris.
    std::fprintf(stderr, "shardkit-ckpt consolidate: --out %s is inside the checkpoint location %s; write it elsewhere\n",
                 c.out.c_str(), o.location.c_str());
    return 2;
  }
  try {
    if (command == "ls") return run_ls(o);
    if (command == "verify") return run_verify(o);
    if (command == "inspect") return run_inspect(o);
    if (command == "gc") return run_gc(o, gc);
    return run_consolidate(o, c);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "shardkit-ckpt %s: %s\n", argv[1], message_of(e).c_str());
    return 1;
  }
}
