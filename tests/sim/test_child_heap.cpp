// The simulation child's small-object heap (simulator/child_heap.hpp). Turned on in a forked
// process, as the executor does, so that this test process keeps malloc.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include <sys/wait.h>
#include <unistd.h>
#include "simulator/child_heap.hpp"

using namespace dssim::sim;

namespace {

// Runs `body` in a child process; its exit status (0 = every check held).
template <class F> int in_child(F body) {
  const pid_t pid = ::fork();
  if (pid == 0) _exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

}  // namespace

TEST_CASE("child heap: off until enabled, then small objects from reused per-size free lists") {
  CHECK(child_heap::carved_bytes() == 0);  // this process never enables it
  const int status = in_child([] {
    auto* before = new std::vector<int>(100, 7);  // malloc'd before enable(), freed after it
    if (!child_heap::enable()) return 1;
    if (child_heap::carved_bytes() != 0) return 2;
    // A freed block is handed out again to the next request of its size class.
    char* a = new char[40];
    delete[] a;
    char* b = new char[33];  // same 16-byte class (48)
    if (b != a) return 3;
    delete[] b;
    // Each size up to kMaxSmall gets usable, 16-byte aligned, distinct memory.
    std::vector<char*> blocks;
    for (std::size_t n = 0; n <= child_heap::kMaxSmall; ++n) {
      char* p = new char[n];
      if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return 4;
      std::memset(p, int(n & 0xff), n);
      blocks.push_back(p);
    }
    for (std::size_t n = 0; n <= child_heap::kMaxSmall; ++n)
      for (std::size_t k = 0; k < n; ++k)
        if (static_cast<unsigned char>(blocks[n][k]) != (n & 0xff)) return 5;
    for (char* p : blocks) delete[] p;
    if (child_heap::carved_bytes() == 0) return 6;
    // Larger requests and pointers from before enable() go to malloc / free.
    const std::size_t carved = child_heap::carved_bytes();
    auto big = std::make_unique<char[]>(child_heap::kMaxSmall + 1);
    if (child_heap::carved_bytes() != carved) return 7;
    big.reset();
    if (before->at(99) != 7) return 8;
    delete before;
    // Many objects alive at once, freed in another order than allocated, then allocated again.
    std::vector<std::unique_ptr<std::string>> live;
    for (int k = 0; k < 200000; ++k) live.push_back(std::make_unique<std::string>(64, char('a' + k % 26)));
    for (std::size_t k = 0; k < live.size(); k += 2) live[k].reset();
    for (std::size_t k = 0; k < live.size(); k += 2) live[k] = std::make_unique<std::string>(64, 'z');
    for (std::size_t k = 0; k < live.size(); ++k)
      if ((*live[k])[63] != (k % 2 == 0 ? 'z' : char('a' + k % 26))) return 9;
    return 0;
  });
  CHECK(status == 0);
}
