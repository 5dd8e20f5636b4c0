// s3_bench: moves one file to and from an S3 location through storage::s3_sink, for scripts/s3-bench (which runs it
// beside s3cmd against the same server). Wall and CPU time are measured around the whole process by the script, as
// for s3cmd; this prints its own figures too.
//
//   s3_bench upload   <file> s3://bucket/prefix <key>    streams the file into one object (1 MiB writes)
//   s3_bench download s3://bucket/prefix <key> <file>    reads the object (parallel ranged GETs) into the file
//
// Part size and parallelism from SHARDKIT_S3_PART_SIZE / SHARDKIT_S3_PARALLEL, endpoint and keys from AWS_*.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <future>
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
      const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) throw std::runtime_error("open " + file + ": " + std::strerror(errno));
      // 64 MiB windows, each parallel ranged GETs of a part size; the next window downloads while this one is
      // written, as a streaming client overlaps the network and the disk.
      constexpr std::size_t window = std::size_t(64) << 20;
      std::vector<std::byte> next_buffer(window);
      buffer.resize(window);
      std::size_t n = sink.get(key, 0, buffer);
      while (true) {
        std::future<std::size_t> next;
        if (n == window)
          next = std::async(std::launch::async, [&, at = bytes + n] { return sink.get(key, at, next_buffer); });
        for (std::size_t done = 0; done < n;) {
          const ssize_t m = ::write(fd, buffer.data() + done, n - done);
          if (m <= 0) throw std::runtime_error("write " + file + ": " + std::strerror(errno));
          done += static_cast<std::size_t>(m);
        }
        bytes += n;
        if (!next.valid()) break;
        n = next.get();
        std::swap(buffer, next_buffer);
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
