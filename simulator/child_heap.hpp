// A small-object heap for the simulation child (executor.cpp's forked process).
//
// SimGrid allocates several small objects per flow (the ExecImpl and its s4u handle, their amount
// and host vectors, the network action, its route) and frees them when the flow ends, in another
// order than it allocated them, with up to a few hundred thousand flows alive at 131,072 GPUs.
// glibc's malloc then spends a growing share of the child in its bins (_int_malloc, _int_free,
// unlink_chunk, malloc_consolidate: 7 % of the CPU at 1,024 GPUs, 19 % at 65,536). This heap
// serves every `operator new` of at most kMaxSmall bytes from per-size free lists carved out of one
// reserved address range: O(1), no coalescing, no trimming, objects of one size packed together.
//
// It replaces the global operator new / delete of the programs that link dssim_simulator, but is
// off (plain malloc / free, plus one range test in delete) until enable() is called, which only
// the simulation child does, after fork() (one thread: the child's allocations need no lock). The
// child never frees its heap: it _exit()s. A pointer from before enable() goes back to free().
#pragma once
#include <cstddef>

namespace dssim::sim::child_heap {

constexpr std::size_t kMaxSmall = 1024;

// Turns the heap on for the rest of this process (single-threaded processes only). False if the
// address range could not be reserved; everything then stays with malloc.
bool enable();

// Bytes of the reserved range handed out so far (slabs carved), for tests and reports.
std::size_t carved_bytes();

}  // namespace dssim::sim::child_heap
