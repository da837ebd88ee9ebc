// A hash map keyed by address for the heap model's live blocks: open
// addressing with linear probing, a power-of-two number of slots, values
// stored in the slots, deletion by backward shift (no tombstones: a table
// that sees millions of alloc/free pairs never fills with dead slots).
//
// std::unordered_map cost the model ~60% of its time (a node allocated per
// block, its find, erase and rehash): here a lookup is a multiply, a shift
// and most often one cache line. The interface is the part of
// std::unordered_map the model and its readers use (find, try_emplace,
// erase, iteration with ->first / ->second); unlike it, an insert or an
// erase moves other entries: every iterator and reference is invalidated by
// either.
//
// Key 0 marks an empty slot; a block at address 0 (a corrupt record) lives
// in one extra slot past the others, so every key works.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <iterator>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace memtrace::heap {

// The slots' memory: tables of 2 MiB and more in transparent huge pages
// where the kernel allows them (madvise mode), as one lookup per record in
// a table of ~100 MB otherwise costs a TLB miss as well as a cache miss
// (W1's blocks: 60 -> 49 ns per operation of the table alone).
template <class T>
struct HugePageAlloc {
  using value_type = T;
  static constexpr size_t kHuge = size_t{2} << 20;
  HugePageAlloc() = default;
  template <class U>
  HugePageAlloc(const HugePageAlloc<U>&) {}
  T* allocate(size_t n) {
    size_t bytes = n * sizeof(T);
    void* p;
    if (bytes < kHuge) {
      p = std::malloc(bytes);
    } else {
      bytes = (bytes + kHuge - 1) & ~(kHuge - 1);
      p = std::aligned_alloc(kHuge, bytes);
      if (p) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: refused or off is fine
    }
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  bool operator==(const HugePageAlloc&) const { return true; }
};

template <class V>
class AddrMap {
 public:
  using key_type = uint64_t;
  using mapped_type = V;
  using value_type = std::pair<uint64_t, V>;  // first: the key; do not change it through an iterator

  template <bool Const>
  class Iter {
   public:
    using value_type = std::pair<uint64_t, V>;
    using reference = std::conditional_t<Const, const value_type&, value_type&>;
    using pointer = std::conditional_t<Const, const value_type*, value_type*>;
    using difference_type = std::ptrdiff_t;
    using iterator_category = std::forward_iterator_tag;
    using Map = std::conditional_t<Const, const AddrMap, AddrMap>;

    Iter() = default;
    Iter(Map* m, size_t i) : m_(m), i_(i) {}
    template <bool C = Const>  // iterator to const_iterator (a template: never the copy constructor)
      requires C
    Iter(const Iter<false>& o) : m_(o.m_), i_(o.i_) {}
    reference operator*() const { return m_->slots_[i_]; }
    pointer operator->() const { return &m_->slots_[i_]; }
    Iter& operator++() {
      i_ = m_->next(i_ + 1);
      return *this;
    }
    Iter operator++(int) {
      Iter t = *this;
      ++*this;
      return t;
    }
    bool operator==(const Iter& o) const { return i_ == o.i_; }
    size_t index() const { return i_; }

   private:
    friend class Iter<!Const>;
    Map* m_ = nullptr;
    size_t i_ = 0;
  };
  using iterator = Iter<false>;
  using const_iterator = Iter<true>;

  AddrMap() = default;

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Slots (a power of two, 0 before the first insert); the table grows past
  // kMaxLoad of them.
  size_t capacity() const { return mask_ ? mask_ + 1 : 0; }

  iterator begin() { return {this, next(0)}; }
  iterator end() { return {this, end_index()}; }
  const_iterator begin() const { return {this, next(0)}; }
  const_iterator end() const { return {this, end_index()}; }

  iterator find(uint64_t k) { return {this, find_index(k)}; }
  const_iterator find(uint64_t k) const { return {this, find_index(k)}; }
  size_t count(uint64_t k) const { return find_index(k) != end_index(); }

  // Inserts (k, v) unless k is there; the entry of k and whether it was inserted.
  std::pair<iterator, bool> try_emplace(uint64_t k, const V& v) {
    if (!k) return emplace_zero(v);
    if (mask_) {
      for (size_t i = home(k);; i = (i + 1) & mask_) {
        uint64_t s = slots_[i].first;
        if (s == k) return {iterator{this, i}, false};
        if (!s) {
          if (size_ + 1 <= max_size_) return {place(i, k, v), true};
          break;
        }
      }
    }
    grow();
    size_t i = home(k);
    while (slots_[i].first) i = (i + 1) & mask_;
    return {place(i, k, v), true};
  }
  std::pair<iterator, bool> emplace(uint64_t k, const V& v) { return try_emplace(k, v); }
  V& operator[](uint64_t k) { return try_emplace(k, V{}).first->second; }

  // Removes the entry at it; entries after it in its cluster move back into
  // the gap when that brings them closer to their home slot.
  void erase(const_iterator it) {
    size_t hole = it.index();
    size_--;
    if (hole == zero_slot()) {
      has_zero_ = false;
      slots_[hole].second = V{};
      return;
    }
    for (size_t j = (hole + 1) & mask_;; j = (j + 1) & mask_) {
      uint64_t k = slots_[j].first;
      if (!k) break;
      // k (home h) may fill the hole if the hole lies on its path h..j.
      if (((j - home(k)) & mask_) >= ((j - hole) & mask_)) {
        slots_[hole] = std::move(slots_[j]);
        hole = j;
      }
    }
    slots_[hole].first = 0;
  }
  size_t erase(uint64_t k) {
    auto it = find(k);
    if (it == end()) return 0;
    erase(it);
    return 1;
  }

  // Keeps the slots (as std::unordered_map::clear keeps its buckets).
  void clear() {
    for (auto& s : slots_) s = value_type{};
    size_ = 0;
    has_zero_ = false;
  }
  // Room for n entries without growing.
  void reserve(size_t n) {
    size_t cap = kMinSlots;
    while (cap * kMaxLoadNum < n * kMaxLoadDen) cap <<= 1;
    if (cap > capacity()) rehash(cap);
  }
  void swap(AddrMap& o) noexcept {
    slots_.swap(o.slots_);
    std::swap(size_, o.size_);
    std::swap(max_size_, o.max_size_);
    std::swap(mask_, o.mask_);
    std::swap(shift_, o.shift_);
    std::swap(has_zero_, o.has_zero_);
  }

  // Slots probed past its home slot to reach k's entry (tests, the bench); -1: not there.
  long probe_distance(uint64_t k) const {
    size_t i = find_index(k);
    if (i == end_index()) return -1;
    return k ? static_cast<long>((i - home(k)) & mask_) : 0;
  }

  // The invariant of linear probing (tests): no empty slot between an
  // entry's home slot and its slot, and size() entries.
  bool valid() const {
    size_t n = has_zero_;
    for (size_t i = 0; mask_ && i <= mask_; i++) {
      uint64_t k = slots_[i].first;
      if (!k) continue;
      n++;
      for (size_t j = home(k); j != i; j = (j + 1) & mask_)
        if (!slots_[j].first) return false;
    }
    return n == size_;
  }

 private:
  // At most 1/2 of the slots used: linear probing's inserts (a miss: 2.5
  // slots on average at 1/2) stay within a cache line or two; at 3/4 a miss
  // probes 8.5 (see bench/model/RESULTS.md).
  static constexpr size_t kMaxLoadNum = 1, kMaxLoadDen = 2;
  static constexpr size_t kMinSlots = 16;

  // Fibonacci hashing: the top bits of k * 2^64/phi. Every bit of the
  // address moves them, so no allocator's layout makes keys pile up (glibc's
  // arenas share their low bits 64 MiB apart, a slab's blocks are 8 or 16
  // bytes apart). A hash that keeps the blocks of one page in neighbouring
  // slots was faster on W1 (28 against 49 ns an operation) but 10x slower
  // on blocks 8 bytes apart (bench/model/RESULTS.md).
  size_t home(uint64_t k) const { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_); }

  size_t zero_slot() const { return mask_ + 1; }
  size_t end_index() const { return mask_ ? mask_ + 2 : 0; }
  size_t next(size_t i) const {
    size_t n = slots_.size();
    if (!n) return 0;
    while (i <= mask_ && !slots_[i].first) i++;
    if (i == zero_slot() && !has_zero_) i++;
    return i;
  }
  size_t find_index(uint64_t k) const {
    if (!mask_) return end_index();
    if (!k) return has_zero_ ? zero_slot() : end_index();
    for (size_t i = home(k);; i = (i + 1) & mask_) {
      uint64_t s = slots_[i].first;
      if (s == k) return i;
      if (!s) return end_index();
    }
  }
  iterator place(size_t i, uint64_t k, const V& v) {
    slots_[i].first = k;
    slots_[i].second = v;
    size_++;
    return {this, i};
  }
  std::pair<iterator, bool> emplace_zero(const V& v) {
    if (!mask_) grow();
    if (has_zero_) return {iterator{this, zero_slot()}, false};
    has_zero_ = true;
    slots_[zero_slot()].second = v;
    size_++;
    return {iterator{this, zero_slot()}, true};
  }
  void grow() { rehash(mask_ ? 2 * (mask_ + 1) : kMinSlots); }
  // cap slots (a power of two) and the zero slot; every entry placed anew.
  void rehash(size_t cap) {
    Slots old(cap + 1);
    old.swap(slots_);
    size_t old_mask = mask_;
    mask_ = cap - 1;
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(cap));
    max_size_ = cap * kMaxLoadNum / kMaxLoadDen;
    if (old.empty()) return;
    for (size_t j = 0; j <= old_mask; j++) {
      if (!old[j].first) continue;
      size_t i = home(old[j].first);
      while (slots_[i].first) i = (i + 1) & mask_;
      slots_[i] = std::move(old[j]);
    }
    slots_[zero_slot()].second = std::move(old[old_mask + 1].second);
  }

  using Slots = std::vector<value_type, HugePageAlloc<value_type>>;
  Slots slots_;  // mask_ + 1 slots, then the zero slot
  size_t size_ = 0, max_size_ = 0, mask_ = 0;
  unsigned shift_ = 64;
  bool has_zero_ = false;
};

}  // namespace memtrace::heap
