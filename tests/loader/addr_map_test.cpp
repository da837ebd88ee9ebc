// The heap model's block table (src/heap/addr_map.h): open addressing with
// linear probing and backward-shift deletion. Collisions are made on purpose
// (keys searched for a chosen home slot), and a randomized run of millions of
// operations is checked against std::unordered_map.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "heap/addr_map.h"
#include "heap/heap_model.h"

using memtrace::heap::AddrMap;

namespace {

// The home slot of k in a table of cap slots (the table's own hash).
size_t home(uint64_t k, size_t cap) {
  return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> (64 - __builtin_ctzll(cap)));
}

// n distinct nonzero keys whose home slot is h in a table of cap slots, above from.
std::vector<uint64_t> keys_at(size_t h, size_t cap, size_t n, uint64_t from = 0x1000) {
  std::vector<uint64_t> v;
  for (uint64_t k = from; v.size() < n; k += 16)
    if (home(k, cap) == h) v.push_back(k);
  return v;
}

std::vector<std::pair<uint64_t, int>> sorted(const AddrMap<int>& m) {
  std::vector<std::pair<uint64_t, int>> v(m.begin(), m.end());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST(AddrMap, EmptyTable) {
  AddrMap<int> m;
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.capacity(), 0u);
  EXPECT_TRUE(m.begin() == m.end());
  EXPECT_TRUE(m.find(0x1000) == m.end());
  EXPECT_TRUE(m.find(0) == m.end());
  EXPECT_EQ(m.count(5), 0u);
  EXPECT_EQ(m.erase(uint64_t{5}), 0u);
  m.clear();
  EXPECT_TRUE(m.valid());
}

TEST(AddrMap, InsertFindEraseAndKeyZero) {
  AddrMap<int> m;
  auto [it, ins] = m.try_emplace(0x1000, 1);
  EXPECT_TRUE(ins);
  EXPECT_EQ(it->first, 0x1000u);
  EXPECT_EQ(it->second, 1);
  // Present already: not replaced.
  auto [it2, ins2] = m.try_emplace(0x1000, 2);
  EXPECT_FALSE(ins2);
  EXPECT_EQ(it2->second, 1);
  // Address 0 is a key like any other (its own slot).
  EXPECT_TRUE(m.try_emplace(0, 7).second);
  EXPECT_FALSE(m.try_emplace(0, 8).second);
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m.find(0)->second, 7);
  EXPECT_EQ(m.probe_distance(0), 0);
  EXPECT_EQ((sorted(m)), (std::vector<std::pair<uint64_t, int>>{{0, 7}, {0x1000, 1}}));
  m[0x2000] = 3;
  EXPECT_EQ(m.find(0x2000)->second, 3);
  EXPECT_EQ(m.erase(uint64_t{0}), 1u);
  EXPECT_TRUE(m.find(0) == m.end());
  EXPECT_EQ(m.erase(uint64_t{0}), 0u);
  m.erase(m.find(0x1000));
  EXPECT_EQ((sorted(m)), (std::vector<std::pair<uint64_t, int>>{{0x2000, 3}}));
  EXPECT_TRUE(m.valid());
  // Zero survives growth.
  m.try_emplace(0, 9);
  for (uint64_t k = 1; k <= 1000; k++) m.try_emplace(k * 16, int(k));
  EXPECT_EQ(m.find(0)->second, 9);
  EXPECT_EQ(m.size(), 1001u);  // 0x2000 is 512 * 16
  EXPECT_TRUE(m.valid());
}

// A cluster of keys with one home: erasing its head shifts every later one
// back by one slot; erasing from its middle leaves the earlier ones alone.
TEST(AddrMap, BackwardShiftWithinACluster) {
  AddrMap<int> m;
  m.reserve(8);  // 16 slots: at most 8 entries
  ASSERT_EQ(m.capacity(), 16u);
  auto k = keys_at(3, 16, 5);
  for (int i = 0; i < 5; i++) m.try_emplace(k[i], i);
  for (int i = 0; i < 5; i++) EXPECT_EQ(m.probe_distance(k[i]), i);
  m.erase(m.find(k[0]));
  for (int i = 1; i < 5; i++) EXPECT_EQ(m.probe_distance(k[i]), i - 1) << i;
  m.erase(m.find(k[2]));
  EXPECT_EQ(m.probe_distance(k[1]), 0);
  EXPECT_EQ(m.probe_distance(k[3]), 1);
  EXPECT_EQ(m.probe_distance(k[4]), 2);
  EXPECT_TRUE(m.find(k[0]) == m.end());
  EXPECT_TRUE(m.find(k[2]) == m.end());
  EXPECT_TRUE(m.valid());
  EXPECT_EQ(m.capacity(), 16u);
}

// An entry at its home slot inside another key's run does not move into a
// hole before its home; the one behind it (home earlier) does.
TEST(AddrMap, BackwardShiftSkipsEntriesAtHome) {
  AddrMap<int> m;
  m.reserve(8);
  auto a = keys_at(4, 16, 3);     // slots 4, 5, 6
  auto b = keys_at(6, 16, 1, a.back() + 16);  // home 6: pushed to 7
  for (uint64_t x : a) m.try_emplace(x, 1);
  m.try_emplace(b[0], 2);
  ASSERT_EQ(m.probe_distance(b[0]), 1);
  m.erase(m.find(a[1]));  // hole at 5: a[2] (home 4, slot 6) moves to 5, b (home 6) to 6
  EXPECT_EQ(m.probe_distance(a[2]), 1);
  EXPECT_EQ(m.probe_distance(b[0]), 0);
  EXPECT_TRUE(m.valid());

  AddrMap<int> n;
  n.reserve(8);
  auto c = keys_at(5, 16, 1);  // slot 5
  auto d = keys_at(6, 16, 1);  // slot 6, at home
  auto e = keys_at(5, 16, 1, c[0] + 16);  // home 5: slot 7
  n.try_emplace(c[0], 1);
  n.try_emplace(d[0], 2);
  n.try_emplace(e[0], 3);
  ASSERT_EQ(n.probe_distance(e[0]), 2);
  n.erase(n.find(c[0]));  // hole at 5: d stays (home 6), e moves to 5
  EXPECT_EQ(n.probe_distance(d[0]), 0);
  EXPECT_EQ(n.probe_distance(e[0]), 0);
  EXPECT_TRUE(n.valid());
}

// A cluster that runs past the last slot continues at slot 0; the shift
// after an erase wraps the same way.
TEST(AddrMap, ClusterWrapsAroundTheEnd) {
  AddrMap<int> m;
  m.reserve(8);
  auto k = keys_at(14, 16, 5);  // slots 14, 15, 0, 1, 2
  for (int i = 0; i < 5; i++) m.try_emplace(k[i], i);
  for (int i = 0; i < 5; i++) EXPECT_EQ(m.probe_distance(k[i]), i);
  auto z = keys_at(0, 16, 1);  // home 0, but slot 0 is taken: slot 3
  m.try_emplace(z[0], 9);
  EXPECT_EQ(m.probe_distance(z[0]), 3);
  m.erase(m.find(k[1]));  // hole at 15: k[2..4] back by one, and z after them
  for (int i = 2; i < 5; i++) EXPECT_EQ(m.probe_distance(k[i]), i - 1);
  EXPECT_EQ(m.probe_distance(z[0]), 2);
  EXPECT_EQ(m.find(z[0])->second, 9);
  EXPECT_TRUE(m.valid());
  // Iteration sees every entry once, the wrapped ones too.
  EXPECT_EQ(sorted(m).size(), 5u);
}

// The table doubles past half full; clear keeps the slots.
TEST(AddrMap, GrowsAtHalfAndClearKeepsSlots) {
  AddrMap<int> m;
  for (int i = 1; i <= 8; i++) m.try_emplace(uint64_t(i) << 4, i);
  EXPECT_EQ(m.capacity(), 16u);
  m.try_emplace(9 << 4, 9);
  EXPECT_EQ(m.capacity(), 32u);
  for (int i = 10; i <= 100000; i++) m.try_emplace(uint64_t(i) << 4, i);
  EXPECT_EQ(m.size(), 100000u);
  EXPECT_EQ(m.capacity(), 262144u);
  EXPECT_TRUE(m.valid());
  for (int i = 1; i <= 100000; i++) ASSERT_EQ(m.find(uint64_t(i) << 4)->second, i);
  m.clear();
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.capacity(), 262144u);
  EXPECT_TRUE(m.begin() == m.end());
  EXPECT_TRUE(m.find(16) == m.end());
  m.try_emplace(16, 1);
  EXPECT_EQ(m.size(), 1u);
}

// glibc's arenas lie 64 MiB apart with the same layout (their blocks share
// their low address bits), a slab's blocks 8 bytes apart: neither piles up
// on neighbouring slots.
TEST(AddrMap, ArenasAndSlabsDoNotCollide) {
  // Mean and longest probe distance of the entries.
  auto probes = [](const AddrMap<int>& m) {
    double sum = 0;
    long worst = 0;
    for (const auto& [k, v] : m) {
      sum += m.probe_distance(k);
      worst = std::max(worst, m.probe_distance(k));
    }
    return std::pair{sum / m.size(), worst};
  };
  AddrMap<int> arenas;
  for (int i = 0; i < 20000; i++)
    for (uint64_t a = 0; a < 8; a++) arenas.try_emplace(0x7f0000000000ull + (a << 26) + 0x8c0 + 48 * i, i);
  EXPECT_EQ(arenas.size(), 160000u);
  auto [mean, worst] = probes(arenas);
  EXPECT_LT(mean, 1.0);
  EXPECT_LT(worst, 64);
  EXPECT_TRUE(arenas.valid());
  AddrMap<int> slab;
  for (int i = 0; i < 200000; i++) slab.try_emplace(0x7f1234560000ull + 8 * i, i);
  std::tie(mean, worst) = probes(slab);
  EXPECT_LT(mean, 1.0);
  EXPECT_LT(worst, 64);
}

TEST(AddrMap, CopySwapAndConstIteration) {
  AddrMap<int> a;
  for (int i = 0; i < 50; i++) a.try_emplace(uint64_t(i) * 48, i);  // key 0 too
  AddrMap<int> b = a;
  b.erase(b.find(48));
  EXPECT_EQ(a.size(), 50u);
  EXPECT_EQ(b.size(), 49u);
  EXPECT_EQ(a.find(48)->second, 1);
  AddrMap<int> c;
  c.swap(b);
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(c.size(), 49u);
  const AddrMap<int>& cc = c;
  int sum = 0;
  for (const auto& [k, v] : cc) sum += v;
  EXPECT_EQ(sum, 49 * 50 / 2 - 1);
  AddrMap<int>::const_iterator it = c.find(96);  // iterator to const_iterator
  EXPECT_EQ(it->second, 2);
  for (auto& [k, v] : c) v++;
  EXPECT_EQ(c.find(96)->second, 3);
}

// Millions of random operations, the same on std::unordered_map: inserts of
// heap-like addresses (16-byte aligned, a few MB, so addresses come back),
// erases by key and through find, lookups of present and absent keys; the
// two agree after every operation and in full every 100,000.
TEST(AddrMap, RandomAgainstUnorderedMap) {
  std::mt19937_64 rng(12345);
  AddrMap<uint64_t> m;
  std::unordered_map<uint64_t, uint64_t> ref;
  auto check_all = [&] {
    ASSERT_EQ(m.size(), ref.size());
    ASSERT_TRUE(m.valid());
    size_t n = 0;
    for (const auto& [k, v] : m) {
      auto r = ref.find(k);
      ASSERT_TRUE(r != ref.end()) << k;
      ASSERT_EQ(r->second, v);
      n++;
    }
    ASSERT_EQ(n, ref.size());
  };
  const int kOps = 3'000'000;
  for (int op = 0; op < kOps; op++) {
    // The key range breathes: small (dense clusters, many hits), then large.
    uint64_t range = (op / 250'000) % 2 ? (1u << 20) : (1u << 14);
    uint64_t k = rng() % 256 == 0 ? 0 : 0x7f0000000000ull + (rng() % range) * 16;  // key 0 now and then
    uint64_t v = rng();
    switch (rng() % 4) {
      case 0:
      case 1: {  // insert
        auto [it, ins] = m.try_emplace(k, v);
        auto [rit, rins] = ref.try_emplace(k, v);
        ASSERT_EQ(ins, rins);
        ASSERT_EQ(it->second, rit->second);
        break;
      }
      case 2: {  // erase through find (the model's free)
        auto it = m.find(k);
        auto rit = ref.find(k);
        ASSERT_EQ(it == m.end(), rit == ref.end());
        if (rit != ref.end()) {
          ASSERT_EQ(it->second, rit->second);
          m.erase(it);
          ref.erase(rit);
        }
        break;
      }
      case 3: {  // erase by key or look up
        if (rng() % 2) {
          ASSERT_EQ(m.erase(k), ref.erase(k));
        } else {
          ASSERT_EQ(m.count(k), ref.count(k));
        }
        break;
      }
    }
    ASSERT_EQ(m.size(), ref.size());
    if (op % 100'000 == 0) check_all();
    // Empty it now and then (console 'clear').
    if (op % 1'000'000 == 999'999) {
      m.clear();
      ref.clear();
    }
  }
  check_all();
}

// The live blocks themselves (a Block with its stack pointer) round-trip.
TEST(AddrMap, HoldsBlocks) {
  AddrMap<memtrace::heap::Block> m;
  memtrace::heap::StackAllocs sa;
  memtrace::heap::Block b{100, 7, 12345, true, false, &sa};
  m.try_emplace(0x55550010, b);
  auto it = m.find(0x55550010);
  ASSERT_TRUE(it != m.end());
  EXPECT_EQ(it->second.size, 100u);
  EXPECT_EQ(it->second.stack_id, 7u);
  EXPECT_EQ(it->second.ts, 12345u);
  EXPECT_TRUE(it->second.touched);
  EXPECT_EQ(it->second.stack, &sa);
}
