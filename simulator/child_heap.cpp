#include "simulator/child_heap.hpp"

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <new>
#include <sys/mman.h>

namespace dssim::sim::child_heap {
namespace {

constexpr std::size_t kGranule = 16;                 // __STDCPP_DEFAULT_NEW_ALIGNMENT__
constexpr std::size_t kClasses = kMaxSmall / kGranule + 1;
constexpr std::size_t kSlab = std::size_t(1) << 16;  // one size class per 64 KiB slab
constexpr std::size_t kCommitStep = std::size_t(1) << 28;

// The reserved range [base, base + size): reserved PROT_NONE, made writable kCommitStep at a time.
// size stays 0 until enable(), so that delete's range test fails for every pointer.
std::uintptr_t g_base = 0;
std::size_t g_size = 0;
std::uintptr_t g_committed = 0;  // end of the writable part
std::uintptr_t g_next = 0;       // next slab to carve
unsigned char* g_slab_class = nullptr;  // per slab: its size class
void* g_free[kClasses] = {};
std::uintptr_t g_cur[kClasses] = {}, g_end[kClasses] = {};

void* carve(std::size_t c) {
  const std::size_t bytes = c * kGranule;
  if (g_cur[c] + bytes > g_end[c]) {
    if (g_next + kSlab > g_base + g_size) return nullptr;
    if (g_next + kSlab > g_committed) {
      if (::mprotect(reinterpret_cast<void*>(g_committed), kCommitStep, PROT_READ | PROT_WRITE) != 0) return nullptr;
      g_committed += kCommitStep;
    }
    g_slab_class[(g_next - g_base) / kSlab] = static_cast<unsigned char>(c);
    g_cur[c] = g_next;
    g_end[c] = g_next + kSlab;
    g_next += kSlab;
  }
  void* p = reinterpret_cast<void*>(g_cur[c]);
  g_cur[c] += bytes;
  return p;
}

inline bool owns(const void* p) { return reinterpret_cast<std::uintptr_t>(p) - g_base < g_size; }

inline void* small(std::size_t n) {
  const std::size_t c = n == 0 ? 1 : (n + kGranule - 1) / kGranule;
  if (void* p = g_free[c]) {
    void* next = *static_cast<void**>(p);
    g_free[c] = next;
    // The next block of this size is usually cold by the time it is asked for (at scale, freed
    // long before among hundreds of MB): fetch it now, so that the next call does not wait for it.
    __builtin_prefetch(next, 1, 3);
    return p;
  }
  return carve(c);
}

inline void release(void* p) {
  if (!owns(p)) {
    std::free(p);
    return;
  }
  const std::size_t c = g_slab_class[(reinterpret_cast<std::uintptr_t>(p) - g_base) / kSlab];
  *static_cast<void**>(p) = g_free[c];
  g_free[c] = p;
}

void* allocate(std::size_t n, bool nothrow) {
  if (n <= kMaxSmall && g_size != 0)
    if (void* p = small(n)) return p;
  for (;;) {
    if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
    std::new_handler h = std::get_new_handler();
    if (h == nullptr) {
      if (nothrow) return nullptr;
      throw std::bad_alloc();
    }
    h();
  }
}

}  // namespace

bool enable() {
  if (g_size != 0) return true;
  // Address space only (PROT_NONE is not committed memory): 1 TiB, else less (valgrind, for one,
  // refuses a 1 TiB mapping).
  for (std::size_t size : {std::size_t(1) << 40, std::size_t(1) << 36, std::size_t(1) << 34, std::size_t(1) << 32}) {
    void* r = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) continue;
    void* t = ::mmap(nullptr, size / kSlab, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (t == MAP_FAILED) {
      ::munmap(r, size);
      continue;
    }
    g_slab_class = static_cast<unsigned char*>(t);
    g_base = g_committed = g_next = reinterpret_cast<std::uintptr_t>(r);
    g_size = size;
    return true;
  }
  return false;
}

std::size_t carved_bytes() { return g_next - g_base; }

}  // namespace dssim::sim::child_heap

// The replaceable allocation functions ([new.delete.single], [new.delete.array]); the aligned
// forms keep the library's (aligned_alloc / free), which never see this heap's pointers.
namespace ch = dssim::sim::child_heap;
void* operator new(std::size_t n) { return ch::allocate(n, false); }
void* operator new[](std::size_t n) { return ch::allocate(n, false); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try { return ch::allocate(n, true); } catch (...) { return nullptr; }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try { return ch::allocate(n, true); } catch (...) { return nullptr; }
}
void operator delete(void* p) noexcept { if (p) ch::release(p); }
void operator delete[](void* p) noexcept { if (p) ch::release(p); }
void operator delete(void* p, std::size_t) noexcept { if (p) ch::release(p); }
void operator delete[](void* p, std::size_t) noexcept { if (p) ch::release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { if (p) ch::release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { if (p) ch::release(p); }
