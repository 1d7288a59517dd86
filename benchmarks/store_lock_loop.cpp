// N uncontended lock+unlock rounds of one implementation, and nothing else,
// so that `strace -f -c` (or perf) over the run divided by N gives the system
// calls of one round:
//
//   store_lock_loop <floor|liblockfile|dibs|dibs-norenew> <rounds> <directory>
//
// One warm-up round runs first (it creates the lock file where an
// implementation leaves one behind); its calls are in the strace total too,
// which is why the run script uses a large N. Prints the rounds' ns/op.
#include <dibs/lease_mutex.hpp>
#include <dibs/lock_file.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#if DIBS_BENCH_HAVE_LIBLOCKFILE
#include <lockfile.h>
#endif

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <floor|liblockfile|dibs|dibs-norenew> <rounds> <directory>\n", argv[0]);
    return 2;
  }
  const std::string_view impl = argv[1];
  const long rounds = std::strtol(argv[2], nullptr, 10);
  const std::filesystem::path dir = argv[3];
  const std::string path = (dir / (std::string(impl) + ".lock")).string();

  std::function<void()> round;
  std::optional<dibs::lock_file> lock;
  if (impl == "floor") {
    round = [&] {
      const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
      if (fd < 0) std::perror("open"), std::exit(1);
      ::close(fd);
      ::unlink(path.c_str());
    };
#if DIBS_BENCH_HAVE_LIBLOCKFILE
  } else if (impl == "liblockfile") {
    round = [&] {
      if (::lockfile_create(path.c_str(), 0, 0) != L_SUCCESS) std::fprintf(stderr, "lockfile_create failed\n"), std::exit(1);
      ::lockfile_remove(path.c_str());
    };
#endif
  } else if (impl == "dibs" || impl == "dibs-norenew") {
    lock.emplace(path, dibs::lease_options{.renew = impl == "dibs"});
    round = [&] {
      lock->lock();
      lock->unlock();
    };
  } else {
    std::fprintf(stderr, "unknown implementation '%s'\n", argv[1]);
    return 2;
  }

  round();  // warm-up
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < rounds; ++i) round();
  const auto t1 = std::chrono::steady_clock::now();
  std::printf("%s: %ld rounds, %.0f ns/op\n", argv[1], rounds,
              std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(rounds));
}
