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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
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
      // As a downloader writes a file: `parallel` threads (SHARDKIT_S3_PARALLEL) take the object's part-size ranges
      // in turn, each get()s its range into its own buffer (one ranged GET over its own connection) and writes it
      // to the file at its offset in 64 KiB pieces, as s3cmd writes. Both other ways cost the client more CPU per GB
      // than the sink itself (docs/benchmarks.md, issue 35): mapping the file faults its new pages in one 4 KiB page
      // at a time from every thread, and large writes make the kernel take large blocks of new page-cache memory,
      // which this project's VMs back slowly.
      const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) throw std::runtime_error("open " + file + ": " + std::strerror(errno));
      const auto size = sink.size(key);
      if (!size) throw std::runtime_error("no object " + key);
      const std::size_t range = sink.options().part_size;
      const std::uint64_t ranges = (*size + range - 1) / range;
      std::atomic<std::uint64_t> next{0}, received{0};
      std::mutex failed_mutex;
      std::exception_ptr failed;
      const auto fetch = [&] {
        try {
          const auto buffer_size = static_cast<std::size_t>(std::min<std::uint64_t>(range, *size));
          const auto buffer = std::make_unique_for_overwrite<std::byte[]>(buffer_size);  // no zeroing pass
          const std::span<std::byte> into(buffer.get(), buffer_size);
          for (std::uint64_t i; (i = next++) < ranges;) {
            const std::uint64_t at = i * range;
            const auto part = into.first(static_cast<std::size_t>(std::min<std::uint64_t>(range, *size - at)));
            const std::size_t got = sink.get(key, at, part);
            if (got != part.size()) throw std::runtime_error("short read of " + key + " at " + std::to_string(at));
            for (std::size_t done = 0; done < got;) {
              const ssize_t n = ::pwrite(fd, part.data() + done, std::min<std::size_t>(got - done, 64 << 10), static_cast<off_t>(at + done));
              if (n < 0) throw std::runtime_error("write " + file + ": " + std::strerror(errno));
              done += static_cast<std::size_t>(n);
            }
            received += got;
          }
        } catch (...) {
          next = ranges;  // the others stop after their current range
          std::lock_guard lock(failed_mutex);
          if (!failed) failed = std::current_exception();
        }
      };
      std::vector<std::thread> threads;
      for (unsigned t = 1; t < std::min<std::uint64_t>(sink.options().parallel, ranges); ++t) threads.emplace_back(fetch);
      fetch();
      for (auto& t : threads) t.join();
      if (failed) std::rethrow_exception(failed);
      bytes = received;
      if (bytes != *size) throw std::runtime_error("short read of " + key);
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
