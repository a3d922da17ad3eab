// The Program builder's index of collapsed chains (BuildOptions::collapse_chains): which chains
// already emitted cost the same as a new one (core/program_builder.cpp, Builder::finish_chain).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace dssim {

// Chains by the hash of their members' costs (Builder::finish_chain): an open-addressing table of
// (hash, chain) entries, several per hash when chains collide, cleared for each build but kept per
// thread (a planner builds thousands of Programs; a map node and a vector per chain were a tenth
// of its allocations).
class ChainIndex {
 public:
  ChainIndex() : slots_(std::move(t_slots)) {
    std::fill(slots_.begin(), slots_.end(), Slot{0, -1});
    count_ = 0;
  }
  ~ChainIndex() { t_slots = std::move(slots_); }
  ChainIndex(const ChainIndex&) = delete;
  ChainIndex& operator=(const ChainIndex&) = delete;

  // The chains inserted with hash h, in no set order (of chains that collide in hash, at most one
  // costs what a new chain does: an equal one is never inserted).
  class Range {
   public:
    Range(const ChainIndex& t, uint64_t h) : t_(t), h_(h) {}
    struct It {
      const ChainIndex* t;
      uint64_t h;
      size_t i;
      int32_t operator*() const { return t->slots_[i].chain; }
      It& operator++() { i = t->next(h, i + 1); return *this; }
      bool operator!=(const It& o) const { return i != o.i; }
    };
    It begin() const { return {&t_, h_, t_.next(h_, t_.home(h_))}; }
    It end() const { return {&t_, h_, kEnd}; }
   private:
    const ChainIndex& t_;
    uint64_t h_;
  };
  Range find(uint64_t h) const { return Range(*this, h); }

  void insert(uint64_t h, int32_t chain) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    place(h, chain);
    ++count_;
  }

 private:
  struct Slot { uint64_t hash; int32_t chain; };  // chain -1: empty
  static constexpr size_t kEnd = ~size_t(0);
  static inline thread_local std::vector<Slot> t_slots;
  std::vector<Slot> slots_;
  size_t count_ = 0;

  size_t home(uint64_t h) const { return slots_.empty() ? kEnd : size_t(h * 0x9E3779B97F4A7C15ull >> 20) & (slots_.size() - 1); }
  // The first slot from i on (wrapping, up to the next empty one) that holds hash h.
  size_t next(uint64_t h, size_t i) const {
    if (slots_.empty() || i == kEnd) return kEnd;
    const size_t mask = slots_.size() - 1;
    for (i &= mask; slots_[i].chain >= 0; i = (i + 1) & mask)
      if (slots_[i].hash == h) return i;
    return kEnd;
  }
  void place(uint64_t h, int32_t chain) {
    const size_t mask = slots_.size() - 1;
    size_t i = home(h);
    while (slots_[i].chain >= 0) i = (i + 1) & mask;
    slots_[i] = {h, chain};
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<size_t>(64, 2 * old.size()), Slot{0, -1});
    for (const Slot& s : old)
      if (s.chain >= 0) place(s.hash, s.chain);
  }
};

}  // namespace dssim
