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

static int usage(const std::string& problem) {
  std::fprintf(stderr,
               "shardkit-tokenize: %s\n"
               "usage: shardkit-tokenize [--split file|paragraph|line] [--dtype uint16|uint32] [--no-offsets] -o OUT INPUT...\n",
               problem.c_str());
  return 2;
}

// Whether two paths name one file (the same inode, or, for one that does not exist yet, the same absolute path).
static bool same_file(const std::filesystem::path& a, const std::filesystem::path& b) {
  std::error_code ec;
  if (std::filesystem::exists(a, ec) && std::filesystem::exists(b, ec)) return std::filesystem::equivalent(a, b, ec);
  return std::filesystem::weakly_canonical(a, ec) == std::filesystem::weakly_canonical(b, ec);
}

int main(int argc, char** argv) {
  data::split_mode split = data::split_mode::file;
  data::token_file_info format = data::byte_token_format();
  std::string out;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: shardkit-tokenize [--split file|paragraph|line] [--dtype uint16|uint32] [--no-offsets] -o OUT INPUT...\n"
                  "Writes OUT (byte tokens 0..255, 256 ends a document), OUT.offsets and OUT.json.\n"
                  "  --split      one document per input file (default), per blank-line-separated paragraph, or per line\n"
                  "  --dtype      token width in the file (default uint16)\n"
                  "  --no-offsets no OUT.offsets (document starts)\n");
      return 0;
    }
    const bool wants_value = a == "--split" || a == "--dtype" || a == "-o";
    if (wants_value && i + 1 >= argc) return usage(std::string(a) + " wants a value");
    const std::string_view v = wants_value ? std::string_view(argv[++i]) : std::string_view();
    if (a == "--split") {
      if (v == "file") split = data::split_mode::file;
      else if (v == "paragraph") split = data::split_mode::paragraph;
      else if (v == "line") split = data::split_mode::line;
      else return usage("--split wants file, paragraph or line, got '" + std::string(v) + "'");
    } else if (a == "--dtype") {
      if (v == "uint16") format.dtype = data::token_type::u16;
      else if (v == "uint32") format.dtype = data::token_type::u32;
      else return usage("--dtype wants uint16 or uint32, got '" + std::string(v) + "'");
    } else if (a == "--no-offsets") {
      format.offsets = false;
    } else if (a == "-o") {
      out = v;
    } else if (a.starts_with("-") && a != "-") {
      return usage("unknown flag " + std::string(a));
    } else {
      inputs.emplace_back(a);
    }
  }
  if (out.empty()) return usage("no output: give -o OUT");
  if (inputs.empty()) return usage("no input: give one or more text files after -o OUT");
  // Checked before anything is written: a mistake leaves no partial output, and no input is overwritten.
  const std::filesystem::path path = std::filesystem::absolute(out);
  {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec) || out.ends_with('/'))
      return usage("-o " + out + " is a directory: -o wants the token file's name (e.g. -o " +
                   (std::filesystem::path(out) / "text.tokens").lexically_normal().string() +
                   "), beside which OUT.offsets and OUT.json are written");
  }
  // OUT.offsets and OUT.json are the sidecars of the token file OUT: an output named like one would replace the
  // sidecar of another token file (-o X.tokens.offsets writes over X.tokens's document starts).
  for (const std::string_view sidecar : {".offsets", ".json"})
    if (out.ends_with(sidecar)) {
      const std::string owner = out.substr(0, out.size() - sidecar.size());
      return usage("-o " + out + " ends in " + std::string(sidecar) + ", the name of a sidecar (" + owner + std::string(sidecar) +
                   " belongs to the token file " + owner + "): give the token file's own name, e.g. -o " + owner +
                   " (OUT.offsets and OUT.json are written beside it)");
    }
  for (const auto& input : inputs) {
    std::error_code ec;
    if (std::filesystem::is_directory(input, ec))
      return usage("'" + input + "' is a directory: give the files in it (" + input + "/*.txt)");
    for (const auto& written : {path.string(), path.string() + ".offsets", path.string() + ".json"})
      if (same_file(input, written))
        return usage("the output " + written + " is also an input: writing it would overwrite '" + input + "'");
  }
  try {
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
