// s3_bench: moves one file to and from an S3 location through storage::s3_sink, for scripts/s3-bench (which runs it
// beside s3cmd against the same server). Wall and CPU time are measured around the whole process by the script, as
// for s3cmd; this prints its own figures too.
//
//   s3_bench upload   <file> s3://bucket/prefix <key>    streams the file into one object (1 MiB writes)
//   s3_bench download s3://bucket/prefix <key> <file>    reads the object (parallel ranged GETs) into the file's pages
//
// Part size and parallelism from SHARDKIT_S3_PART_SIZE / SHARDKIT_S3_PARALLEL, endpoint and keys from AWS_*.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "shardkit/storage/s3_sink.hpp"

namespace st = shardkit::storage;

static double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

int main(int argc, char** argv) {
  if (argc != 5 || (std::strcmp(argv[1], "upload") && std::strcmp(argv[1], "download"))) {
    std::fprintf(stderr, "usage: s3_bench upload <file> s3://bucket/prefix <key>\n"
                         "       s3_bench download s3://bucket/prefix <key> <file>\n");
    return 2;
  }
  try {
    const bool upload = !std::strcmp(argv[1], "upload");
    const std::string file = upload ? argv[2] : argv[4], location = upload ? argv[3] : argv[2], key = argv[upload ? 4 : 3];
    st::s3_sink sink(location);
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_seconds();
    std::uint64_t bytes = 0;
    std::vector<std::byte> buffer;
    if (upload) {
      const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw std::runtime_error("open " + file + ": " + std::strerror(errno));
      buffer.resize(1 << 20);
      auto w = sink.put(key);
      while (true) {
        const ssize_t n = ::read(fd, buffer.data(), buffer.size());
        if (n < 0) throw std::runtime_error("read " + file + ": " + std::strerror(errno));
        if (n == 0) break;
        w.write(std::span(buffer).first(static_cast<std::size_t>(n)));
        bytes += static_cast<std::uint64_t>(n);
      }
      w.commit();
      ::close(fd);
    } else {
      // The object goes straight into the file's pages: the file is sized and mapped, and one get() fetches it in
      // parallel ranges of a part size, each written by libcurl's callback into the mapping as it arrives. A copy
      // through a buffer and write() would copy every byte once more, from memory long out of cache (most of this
      // process's CPU: docs/benchmarks.md, issue 35); a checkpoint load gets into its buffers the same way.
      const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) throw std::runtime_error("open " + file + ": " + std::strerror(errno));
      const auto size = sink.size(key);
      if (!size) throw std::runtime_error("no object " + key);
      if (*size) {
        if (::ftruncate(fd, static_cast<off_t>(*size)) != 0) throw std::runtime_error("ftruncate " + file + ": " + std::strerror(errno));
        void* map = ::mmap(nullptr, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) throw std::runtime_error("mmap " + file + ": " + std::strerror(errno));
        bytes = sink.get(key, 0, std::span(static_cast<std::byte*>(map), *size));
        ::munmap(map, *size);
        if (bytes != *size) throw std::runtime_error("short read of " + key);
      }
      ::close(fd);
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = cpu_seconds() - c0;
    std::printf("%s %llu bytes in %.3f s: %.3f GB/s, cpu %.3f s (%.3f s/GB)\n", argv[1],
                static_cast<unsigned long long>(bytes), wall, double(bytes) / wall / 1e9, cpu, cpu / (double(bytes) / 1e9));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "s3_bench: %s\n", e.what());
    return 1;
  }
}
