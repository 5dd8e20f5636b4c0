#pragma once
// The trainer's --data: the token files it reads through the data loader, and the batches it takes from it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/comm/process_group.hpp"
#include "shardkit/data/loader.hpp"
#include "shardkit/data/tokenize.hpp"
#include "shardkit/storage/open_sink.hpp"
#include "trainer/model.hpp"

namespace trainer {

namespace sk = shardkit;

// The token files under `location` that the trainer reads: those named *.tokens (what shardkit-tokenize and
// --init-data write) and any other with a token-file sidecar (<key>.json) beside it; a sidecar or offsets object
// left without its token file counts as that file, so that the loader's error names it. Anything else there (a
// notes.txt, a README) is not training data: it is skipped, and rank 0 says so, once.
// `skipped_out`, when given, gets the skipped keys.
inline std::vector<std::string> token_files_to_read(sk::storage::any_sink& sink, const std::string& location, bool say,
                                                    std::vector<std::string>* skipped_out = nullptr) {
  std::vector<std::string> read, skipped;
  for (auto& key : sk::data::list_token_files(sink, ""))
    (key.ends_with(".tokens") || sink.exists(sk::data::sidecar_key(key)) || !sink.exists(key) ? read : skipped)
        .push_back(std::move(key));
  if (say && !skipped.empty()) {
    std::string names;
    for (const auto& k : skipped) names += (names.empty() ? "" : ", ") + k;
    std::printf("# data: skipped %s in %s: not token files (the trainer reads *.tokens, and files with a .json "
                "sidecar)\n", names.c_str(), location.c_str());
  }
  if (skipped_out) *skipped_out = std::move(skipped);
  return read;
}

// Opens the token files at `location` for the loader. A location without token files is an error (a mistyped
// path must not train on something else), unless `init`: then rank 0 writes the built-in text there first (byte
// tokens, one document per line); so is a token file without its sidecar. Every rank checks, so every rank fails
// alike.
inline std::pair<sk::storage::any_sink, sk::data::loader_options> open_data(const std::string& location, bool init, const std::string& text,
                                                                     sk::comm::process_group& pg, int rows, int T, std::uint64_t seed) {
  const std::string make = "write token files there with shardkit-tokenize -o " + location +
                           "/text.tokens FILE..., or add --init-data to write the built-in text there first";
  // A token file given for its directory (--data data/text.tokens) was said to be "no such directory".
  if (!location.starts_with("s3://") && std::filesystem::is_regular_file(location)) {
    const std::string dir = std::filesystem::path(location).parent_path().string();
    throw std::runtime_error("--data " + location + " is a file: --data wants the directory that holds the token files (--data " +
                             (dir.empty() ? "." : dir) + ")");
  }
  if (!init && !location.starts_with("s3://") && !std::filesystem::is_directory(location))
    throw std::runtime_error("--data " + location + ": no such directory (a mistyped path?): " + make);
  auto sink = sk::storage::open_sink(location);
  std::vector<std::string> skipped;
  const bool empty = token_files_to_read(sink, location, false, &skipped).empty();
  if (empty && !init) {
    // What is there instead (a notes.txt, a text not yet tokenized) is named: it is why the user thought it data.
    std::string others;
    for (const auto& k : skipped) others += (others.empty() ? "" : ", ") + k;
    throw std::runtime_error("--data " + location + " holds no token files" +
                             (others.empty() ? "" : " (it holds " + others + ": not token files, which are *.tokens or have a "
                                                    ".json sidecar)") + ": " + make);
  }
  if (pg.rank() == 0 && empty) {
    sk::data::token_file_writer w(sink, "builtin.tokens", sk::data::byte_token_format());
    for (auto doc : sk::data::split_documents(text, sk::data::split_mode::line)) sk::data::add_byte_document(w, doc);
    w.finish();
    std::printf("# data: wrote the built-in text as byte tokens to %s\n", location.c_str());
  }
  pg.barrier().wait();
  // Another run started with --init-data on this location at the same time may have written the built-in text's
  // tokens and not yet its sidecar (written last): read without it, the delimiters would be data. Wait for it.
  for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       init && sink.exists("builtin.tokens") && !sink.exists(sk::data::sidecar_key("builtin.tokens"));) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("--data " + location + ": builtin.tokens has no sidecar (builtin.tokens.json) after 10 s: a "
                               "run's --init-data was stopped while writing it; remove builtin.tokens* there and run again");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  sk::data::loader_options o;
  o.datasets = {{.name = "text", .files = token_files_to_read(sink, location, pg.rank() == 0)}};
  // Read with the dataset's defaults, a file without its sidecar would be taken for other tokens than it holds
  // (its delimiters for data, found steps later as a token beyond the vocab): refused at once.
  for (const auto& key : o.datasets.front().files)
    if (sink.exists(key) && !sink.exists(sk::data::sidecar_key(key)))
      throw std::runtime_error("--data " + location + ": " + key + " has no sidecar (" + sk::data::sidecar_key(key) +
                               "), which says how its tokens are stored: copy it beside the file (shardkit-tokenize "
                               "writes both)");
  o.sequence_length = std::size_t(T) + 1;
  o.batch_size = std::size_t(rows);
  o.seed = seed;
  o.eos = '\n';  // the model's vocabulary is the 256 bytes: a newline ends a document
  o.vocab = 256;  // a token the model cannot embed is an error naming the file, not a byte of another value
  return {sink, o};
}

// A sequence longer than the whole dataset would repeat it within one row: refused, naming both sizes.
inline void refuse_context_beyond_data(const sk::data::loader& loader, int T, const std::string& location) {
  const std::uint64_t tokens = loader.dataset_tokens(0);
  if (std::uint64_t(T) + 1 > tokens)
    throw std::runtime_error("--context " + std::to_string(T) + ": a row is " + std::to_string(T + 1) + " tokens, more than the " +
                             std::to_string(tokens) + " tokens of --data " + location +
                             " in all: give a --context below that, or more data");
}

inline batch next_batch(sk::data::loader& loader, int rows, int T) {
  const sk::data::batch in = loader.next();
  // The loader runs forever (epochs = 0) and pads nothing then; a short batch would be read past its end.
  if (in.size() != std::size_t(rows) || std::ranges::any_of(in.lengths, [&](std::uint32_t n) { return n != std::uint32_t(T) + 1; }))
    throw std::runtime_error("--data: the loader delivered " + std::to_string(in.size()) + " sequences (some shorter than " +
                             std::to_string(T + 1) + " tokens?), not " + std::to_string(rows));
  batch b;
  b.B = rows;
  b.T = T;
  b.tokens.resize(in.tokens.size());
  for (std::size_t i = 0; i < in.tokens.size(); ++i) b.tokens[i] = static_cast<std::uint8_t>(in.tokens[i]);
  return b;
}

}  // namespace trainer
