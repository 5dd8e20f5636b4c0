#pragma once
//! The bodies behind ckpt/checkpointer.hpp that read checkpoints back: the newest one (rank 0 looks, every rank
//! learns), a load of one step, and load_latest's fall-back past damaged steps with its account of what it passed
//! over. Included by ckpt/impl/checkpointer.hpp, compiled with it.
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/ckpt/impl/checkpointer_save_job.hpp"

namespace shardkit::ckpt {

SHARDKIT_DECL std::optional<std::uint64_t> checkpointer::latest() { return find_latest(nullptr, nullptr, nullptr); }

SHARDKIT_DECL std::optional<std::uint64_t> checkpointer::find_latest(std::optional<checkpoint_index>* parsed_on_rank0,
                                                                     std::vector<unreadable_index>* unreadable_on_rank0,
                                                                     listing* listed_on_rank0) {
  wait_for_saves();
  std::int64_t found = -1;
  std::string failure;
  if (rank_ == 0) {
    try {
      listing listed = list_checkpoints(sink_, opts_.prefix);
      auto index = latest_checkpoint(sink_, opts_.prefix, listed, unreadable_on_rank0);
      if (listed_on_rank0) *listed_on_rank0 = std::move(listed);
      if (index) {
        found = static_cast<std::int64_t>(index->step);
        if (parsed_on_rank0) *parsed_on_rank0 = std::move(index);
      }
    } catch (const std::exception& e) {
      failure = e.what();
      found = -2;
    }
  }
  group_.broadcast(buffer_view(std::span<std::int64_t>(&found, 1)), 0).wait();
  if (found == -2)
    throw_error(errc::io, "finding the latest checkpoint failed on rank 0" + (failure.empty() ? "" : ": " + failure),
                {.rank = rank_, .operation = "ckpt.latest", .object = opts_.prefix});
  if (found < 0) return std::nullopt;
  return static_cast<std::uint64_t>(found);
}

SHARDKIT_DECL void checkpointer::refuse_what_no_rank_asks(const checkpoint_index& index, const state_dict& into) {
  auto asked = detail::asked_for(index, into);
  if (!asked.empty()) calls_group_.all_reduce(buffer_view(std::span<std::uint8_t>(asked)), reduce_op::max).wait();
  const auto left = detail::names_not_asked(index, asked);
  if (left.empty()) return;
  std::string names;
  for (std::size_t i = 0; i < left.size() && i < 6; ++i) names += (i ? ", " : "") + left[i];
  if (left.size() > 6) names += ", ...";
  throw_error(errc::invalid_argument,
              "a strict load of the checkpoint of step " + std::to_string(index.step) + " refuses it: it holds " +
                  std::to_string(left.size()) + (left.size() == 1 ? " entry" : " entries") + " that no rank's state asks for (" +
                  names + "); it was saved with another configuration" +
                  (detail::recorded_metadata(index).empty() ? std::string{} : " (it records " + detail::recorded_metadata(index) + ")") +
                  " (load_scope::what_state_asks loads the rest)",
              {.rank = rank_, .operation = "ckpt.load", .object = index_key(opts_.prefix, index.step)});
}

SHARDKIT_DECL load_report checkpointer::load(std::uint64_t step, const state_dict& into, load_scope scope) {
  wait_for_saves();
  take_lease_before_loading();
  auto index = read_index(sink_, opts_.prefix, step);
  if (!index)
    throw_error(errc::not_found, "no checkpoint of step " + std::to_string(step) + " (no index " + index_key(opts_.prefix, step) + ")",
                {.rank = rank_, .operation = "ckpt.load", .object = index_key(opts_.prefix, step)});
  auto report = load_index(*index, into, scope);
  note_loaded(report);
  return report;
}

SHARDKIT_DECL load_report checkpointer::load_index(const checkpoint_index& index, const state_dict& into, load_scope scope) {
  // Every rank reads the same index: all refuse alike, before the strict load's collective.
  check_expected_metadata(index, opts_.metadata, "checkpoint " + index_key(opts_.prefix, index.step), rank_);
  if (scope == load_scope::everything) refuse_what_no_rank_asks(index, into);
  return load_state(sink_, index, into, rank_, world_, "checkpoint " + index_key(opts_.prefix, index.step),
                    {.device = opts_.device});
}

SHARDKIT_DECL std::optional<load_report> checkpointer::load_latest(const state_dict& into, load_scope scope) {
  std::optional<checkpoint_index> parsed;
  // Steps passed over, newest first: those that did not load (on every rank), and those whose index does not parse
  // (rank 0 finds them while it looks for the next one; every rank learns them at the end).
  std::map<std::uint64_t, std::string, std::greater<>> passed;
  std::vector<unreadable_index> unreadable;
  listing listed;  // rank 0's, taken once: the fall-backs and the account below look in it
  take_lease_before_loading();  // before the listing and the index (hundreds of megabytes for a large job)
  auto step = find_latest(&parsed, &unreadable, &listed);
  // `loaded`: the step that loads; rank 0 also names the newer steps that hold files but no index (a save that
  // did not complete: a rank stopped or killed during it), so that a resume says why it goes back past them.
  auto learn_unreadable = [&](std::optional<std::uint64_t> loaded = std::nullopt) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& u : unreadable) j.push_back({u.step, "its index does not parse: " + u.why});
    if (rank_ == 0 && loaded)
      for (const auto& [s, keys] : listed.keys_by_step) {
        if (s <= *loaded || std::ranges::find(keys, index_key(opts_.prefix, s)) != keys.end()) continue;
        const auto rank_files = std::ranges::count_if(keys, [](const std::string& k) { return k.ends_with(".safetensors"); });
        j.push_back({s, "its save did not complete (no index; " + std::to_string(rank_files) + " rank file(s) written): " +
                            "a later save of that step replaces it"});
      }
    const std::string text = world_ > 1 ? broadcast_string(rank_ == 0 ? j.dump() : std::string{}, 0) : j.dump();
    for (const auto& u : nlohmann::json::parse(text)) passed.emplace(u[0].get<std::uint64_t>(), u[1].get<std::string>());
    std::vector<std::string> out;
    for (const auto& [s, why] : passed) out.push_back("step " + std::to_string(s) + ": " + why);
    return out;
  };
  while (step) {
    // 0: loaded; 1: its data is damaged (a file absent, cut short, a checksum): an older one may load; 2: anything
    // else (the state does not fit, a lost peer): thrown.
    std::int64_t outcome = 0;
    std::string why;
    std::optional<load_report> report;
    try {
      if (!parsed) parsed = read_index(sink_, opts_.prefix, *step);
      if (!parsed)
        throw_error(errc::not_found, "no checkpoint of step " + std::to_string(*step) + " (no index " + index_key(opts_.prefix, *step) + ")",
                    {.rank = rank_, .operation = "ckpt.load", .object = index_key(opts_.prefix, *step)});
      // A file whose size is not its index's record is damaged (as shardkit-ckpt ls says) even where the bytes the
      // index names read back whole: rank 0 checks every file's size (one stat or HEAD each) and every rank learns
      // the verdict before any loads (a load's collectives then run on all ranks or none).
      std::string wrong_size;
      if (rank_ == 0)
        for (const auto& f : parsed->files) {
          std::optional<std::uint64_t> size;
          try {
            size = sink_.size(f.key);
          } catch (const std::exception&) {  // the load itself says what a file that cannot be read is
          }
          if (size && *size != f.size) {
            wrong_size = "rank file " + f.key + " is " + std::to_string(*size) + " bytes, its index records " + std::to_string(f.size);
            break;
          }
        }
      if (world_ > 1) wrong_size = broadcast_string(wrong_size, 0);
      if (!wrong_size.empty())
        throw_error(errc::io, wrong_size, {.rank = rank_, .operation = "ckpt.load", .object = index_key(opts_.prefix, *step)});
      report = load_index(*parsed, into, scope);
    } catch (const shardkit::error& e) {
      const bool damaged = e.code() == make_error_code(errc::io) || e.code() == make_error_code(errc::not_found) ||
                           e.code() == make_error_code(errc::protocol);
      if (!damaged) throw;  // on every rank alike: a state that does not fit fits no older checkpoint either
      outcome = 1;
      why = e.what();
    }
    std::vector<std::int64_t> outcomes(static_cast<std::size_t>(world_));
    calls_group_.all_gather(const_buffer_view(&outcome, 1, dtype::i64), buffer_view(outcomes.data(), outcomes.size(), dtype::i64)).wait();
    const auto failed = std::find(outcomes.begin(), outcomes.end(), 1);
    if (failed == outcomes.end()) {
      report->passed_over = learn_unreadable(*step);
      note_loaded(*report);
      // This run saves the steps after the one it loaded: the damaged ones stand in the way, and are moved aside
      // (never deleted) by its first save, once it holds the location's lease (open_for_saves).
      if (!opened_)
        for (const auto& [s, reason] : passed) damaged_steps_[s] = reason;
      else if (!passed.empty() && rank_ == 0)
        log::warn("ckpt: the damaged steps this load passed over stay where they are (this run saved before it loaded); "
                  "a save of one of those steps is refused");
      return report;
    }
    // Every rank names the same step, rank and reason, and goes on to the next older complete checkpoint.
    const int culprit = static_cast<int>(failed - outcomes.begin());
    why = broadcast_string(why, culprit);
    passed.emplace(*step, "rank " + std::to_string(culprit) + ": " + why);
    if (rank_ == 0)
      log::warn("ckpt: the latest checkpoint, step ", *step, ", does not load on rank ", culprit, " (", why,
                "): falling back to an older one", opened_ ? "" : "; this run's first save moves it aside, to step-*.damaged");
    std::int64_t older = -1;
    parsed.reset();
    if (rank_ == 0)
      if ((parsed = latest_checkpoint(sink_, opts_.prefix, listed, &unreadable, *step))) older = static_cast<std::int64_t>(parsed->step);
    calls_group_.broadcast(buffer_view(std::span<std::int64_t>(&older, 1)), 0).wait();
    step = older < 0 ? std::nullopt : std::optional<std::uint64_t>(static_cast<std::uint64_t>(older));
  }
  const auto passed_over = learn_unreadable();
  if (passed_over.empty()) return std::nullopt;
  std::string all;
  for (const auto& p : passed_over) all += (all.empty() ? "" : "; ") + p;
  const std::string where = opts_.location.empty() ? (opts_.prefix.empty() ? std::string("the sink's root") : "prefix '" + opts_.prefix + "'")
                                                   : "'" + opts_.location + "'";
  throw_error(errc::io, "no complete checkpoint under " + where + " loads: " + all,
              {.rank = rank_, .operation = "ckpt.load", .object = opts_.prefix});
}

SHARDKIT_DECL std::vector<std::vector<std::byte>> checkpointer::read_rank_bytes(std::uint64_t step, const std::string& name) {
  auto index = read_index(sink_, opts_.prefix, step);
  if (!index)
    throw_error(errc::not_found, "no checkpoint of step " + std::to_string(step),
                {.rank = rank_, .operation = "ckpt.load", .object = index_key(opts_.prefix, step)});
  return ckpt::read_rank_bytes(sink_, *index, name);
}

}  // namespace shardkit::ckpt
