// The function symbols of a module, sorted by address, as the symbolizer
// searches them (ELF reading itself is src/elf/image.h).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "elf/image.h"

namespace memtrace::symbolize {

// A function symbol, sorted by address in SymbolTable.
struct SymbolEntry {
  uint64_t addr = 0, size = 0;
  uint32_t name = 0;  // offset in SymbolTable::names
  uint8_t rank = 0;   // preference among symbols at one address (higher wins)
};

class SymbolTable {
 public:
  void add(uint64_t addr, uint64_t size, std::string_view name, uint8_t rank);
  // The function symbols of img's .symtab (and .dynsym when dynsym = true),
  // "@VERSION" dropped, ranked .symtab over .dynsym, global over weak over local.
  void add_functions(const elf::Image& img, bool symtab, bool dynsym);
  void finish();  // sort + dedupe; call once after the adds
  // The symbol whose size covers vaddr, else the nearest one below it (the
  // caller bounds that by the code section).
  const SymbolEntry* find(uint64_t vaddr) const;
  const char* name(const SymbolEntry& e) const { return names_.data() + e.name; }
  size_t size() const { return syms_.size(); }

 private:
  std::vector<SymbolEntry> syms_;
  std::string names_;
};

}  // namespace memtrace::symbolize
