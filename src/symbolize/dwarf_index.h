// DWARF of one module through libdw: which compile unit covers an address
// (an index of CU ranges built once), the line-table row, and the chain of
// inlined subroutines, the way `eu-addr2line -i` reads them.
#pragma once
#include <elfutils/libdw.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace memtrace::elf {
class Image;
}  // namespace memtrace::elf

namespace memtrace::symbolize {

struct DwarfFrame {
  std::string name;  // linkage name when there is one (mangled), else DW_AT_name; "" if none
  bool linkage = false;  // name is a linkage (mangled or C) name
  std::string file;  // "" if unknown
  int line = 0, column = 0;
  bool inlined = false;
  uint64_t entry = 0;  // entry pc of the function / inlined instance, 0 if unknown
};

class DwarfIndex {
 public:
  // nullptr when the image has no usable DWARF.
  static std::unique_ptr<DwarfIndex> create(const elf::Image& img);
  ~DwarfIndex();
  DwarfIndex(const DwarfIndex&) = delete;
  DwarfIndex& operator=(const DwarfIndex&) = delete;

  // Frames for vaddr, innermost first. false when no compile unit covers it.
  bool lookup(uint64_t vaddr, std::vector<DwarfFrame>& out);
  size_t cu_count() const { return cu_count_; }

 private:
  DwarfIndex() = default;
  struct CuRange {
    uint64_t lo, hi;
    Dwarf_Off cu_die;
  };
  // Function scopes of one CU (subprograms, inlined subroutines), walked once
  // on the CU's first lookup and flattened into disjoint address segments,
  // each naming its innermost scope: a lookup is a binary search.
  struct CuFunctions {
    struct Scope {
      Dwarf_Off die;
      int32_t parent;  // index of the enclosing function scope, -1 if none
    };
    std::vector<Scope> scopes;
    std::vector<std::pair<uint64_t, int32_t>> segments;  // start -> scope (-1: none)
  };
  const CuFunctions& functions_of(Dwarf_Die* cudie);

  Dwarf* dw_ = nullptr;
  std::vector<CuRange> ranges_;
  std::unordered_map<Dwarf_Off, CuFunctions> cu_functions_;
  size_t cu_count_ = 0;
};

}  // namespace memtrace::symbolize
