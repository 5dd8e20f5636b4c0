// shardkit-tokenize: text files to a token file for shardkit::data::loader (byte-level tokens).
//
//   shardkit-tokenize [--split file|paragraph|line] [--dtype uint16|uint32] [--no-offsets] -o OUT INPUT...
//
// Writes OUT (the tokens), OUT.offsets (unless --no-offsets) and OUT.json (the sidecar), each atomically (posix_sink:
// temporary + rename), and prints the sidecar. Every byte is a token (0..255); 256 ends each document (vocab 257).
// --split: one document per input file (default), per blank-line-separated paragraph, or per line.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/data/tokenize.hpp"
#include "shardkit/storage/posix_sink.hpp"

namespace data = shardkit::data;

static int usage() {
  std::fprintf(stderr, "usage: shardkit-tokenize [--split file|paragraph|line] [--dtype uint16|uint32] [--no-offsets] -o OUT INPUT...\n");
  return 2;
}

int main(int argc, char** argv) {
  data::split_mode split = data::split_mode::file;
  data::token_file_info format = data::byte_token_format();
  std::string out;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string_view { return i + 1 < argc ? std::string_view(argv[++i]) : std::string_view(); };
    if (a == "--split") {
      const auto v = value();
      if (v == "file") split = data::split_mode::file;
      else if (v == "paragraph") split = data::split_mode::paragraph;
      else if (v == "line") split = data::split_mode::line;
      else return usage();
    } else if (a == "--dtype") {
      const auto v = value();
      if (v == "uint16") format.dtype = data::token_type::u16;
      else if (v == "uint32") format.dtype = data::token_type::u32;
      else return usage();
    } else if (a == "--no-offsets") {
      format.offsets = false;
    } else if (a == "-o") {
      out = value();
    } else if (a.starts_with("-")) {
      return usage();
    } else {
      inputs.emplace_back(a);
    }
  }
  if (out.empty() || inputs.empty()) return usage();
  try {
    const std::filesystem::path path = std::filesystem::absolute(out);
    auto sink = shardkit::storage::make_sink<shardkit::storage::posix_sink>(path.parent_path());
    data::token_file_writer writer(sink, path.filename().string(), format);
    for (const auto& input : inputs) {
      std::ifstream in(input, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "shardkit-tokenize: cannot read '%s'\n", input.c_str());
        return 1;
      }
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      for (auto document : data::split_documents(text, split)) data::add_byte_document(writer, document);
    }
    std::printf("%s\n", data::to_json(writer.finish()).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit-tokenize: %s\n", e.what());
    return 1;
  }
  return 0;
}
