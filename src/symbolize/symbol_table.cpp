#include "symbolize/symbol_table.h"

#include <elf.h>

#include <algorithm>
#include <cstdint>

namespace memtrace::symbolize {

void SymbolTable::add(uint64_t addr, uint64_t size, std::string_view name, uint8_t rank) {
  if (names_.size() > UINT32_MAX - name.size() - 1) return;  // absurd string volume
  SymbolEntry e;
  e.addr = addr;
  e.size = size;
  e.name = static_cast<uint32_t>(names_.size());
  e.rank = rank;
  names_.append(name);
  names_.push_back('\0');
  syms_.push_back(e);
}

void SymbolTable::add_functions(const elf::Image& img, bool symtab, bool dynsym) {
  img.for_each_symbol(symtab, dynsym, [&](const elf::SymbolRecord& s) {
    if (s.type != STT_FUNC && s.type != STT_GNU_IFUNC) return;
    if (s.shndx == SHN_UNDEF || s.value == 0 || s.name.empty()) return;
    std::string_view nv = s.name.substr(0, s.name.find('@'));
    uint8_t rank = s.bind == STB_GLOBAL ? 3 : s.bind == STB_WEAK ? 2 : 1;
    if (!s.dynamic) rank += 3;
    add(s.value, s.size, nv, rank);
  });
}

void SymbolTable::finish() {
  std::sort(syms_.begin(), syms_.end(), [](const SymbolEntry& a, const SymbolEntry& b) {
    if (a.addr != b.addr) return a.addr < b.addr;
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.size > b.size;
  });
  std::vector<SymbolEntry> out;
  out.reserve(syms_.size());
  for (const auto& s : syms_) {
    if (!out.empty() && out.back().addr == s.addr) {
      out.back().size = std::max(out.back().size, s.size);
      continue;
    }
    out.push_back(s);
  }
  syms_ = std::move(out);
}

const SymbolEntry* SymbolTable::find(uint64_t vaddr) const {
  auto it = std::upper_bound(syms_.begin(), syms_.end(), vaddr,
                             [](uint64_t v, const SymbolEntry& e) { return v < e.addr; });
  if (it == syms_.begin()) return nullptr;
  size_t i = static_cast<size_t>(it - syms_.begin()) - 1;
  // A symbol whose size covers vaddr (a few steps back for nested symbols),
  // else the nearest preceding one, as binutils does (padding, size-less asm).
  for (size_t j = i, steps = 0; steps < 16; ++steps) {
    const SymbolEntry& e = syms_[j];
    if (e.size > 0 && vaddr - e.addr < e.size) return &e;
    if (j == 0) break;
    --j;
  }
  return &syms_[i];
}

}  // namespace memtrace::symbolize
