#include "symbolize/dwarf_index.h"

#include <dwarf.h>

#include <algorithm>

#include "symbolize/elf_image.h"

namespace memtrace::symbolize {
namespace {

// Bounds against hostile DWARF: a lookup never walks more DIEs than this, an
// inline chain is never deeper, the CU index never holds more ranges.
constexpr size_t kMaxVisits = 4'000'000;
constexpr size_t kMaxDepth = 512;
constexpr size_t kMaxRanges = 8'000'000;

const char* die_name(Dwarf_Die* die, bool& linkage) {
  Dwarf_Attribute a;
  const char* n = dwarf_formstring(dwarf_attr_integrate(die, DW_AT_linkage_name, &a));
  if (!n) n = dwarf_formstring(dwarf_attr_integrate(die, DW_AT_MIPS_linkage_name, &a));
  linkage = n != nullptr;
  if (!n) n = dwarf_formstring(dwarf_attr_integrate(die, DW_AT_name, &a));
  return n;
}

bool is_function(int tag) {
  return tag == DW_TAG_subprogram || tag == DW_TAG_inlined_subroutine || tag == DW_TAG_entry_point;
}

bool is_pc_scope(int tag) {
  return is_function(tag) || tag == DW_TAG_lexical_block || tag == DW_TAG_try_block ||
         tag == DW_TAG_catch_block || tag == DW_TAG_with_stmt;
}

// Containers that hold functions without having a pc range themselves.
bool is_container(int tag) {
  return tag == DW_TAG_namespace || tag == DW_TAG_class_type || tag == DW_TAG_structure_type ||
         tag == DW_TAG_union_type || tag == DW_TAG_module;
}

int attr_int(Dwarf_Die* die, int name) {
  Dwarf_Attribute a;
  Dwarf_Word v;
  if (dwarf_formudata(dwarf_attr(die, name, &a), &v) != 0) return 0;
  return v > 0x7fffffff ? 0 : static_cast<int>(v);
}

// Chain of function scopes (subprogram / inlined_subroutine) containing pc,
// outermost first, from the concrete DIE tree of the CU.
std::vector<Dwarf_Die> function_chain(Dwarf_Die* cudie, uint64_t pc) {
  std::vector<Dwarf_Die> chain;
  std::vector<Dwarf_Die> resume;  // containers entered, to continue after their children
  Dwarf_Die cur;
  int rc = dwarf_child(cudie, &cur);
  size_t visits = 0;
  while (visits++ < kMaxVisits) {
    if (rc != 0) {  // no more siblings at this level: leave a container
      if (resume.empty()) break;
      Dwarf_Die c = resume.back();
      resume.pop_back();
      Dwarf_Off o = dwarf_dieoffset(&c);
      rc = dwarf_siblingof(&c, &cur);
      if (rc == 0 && dwarf_dieoffset(&cur) <= o) break;
      continue;
    }
    int tag = dwarf_tag(&cur);
    if (is_pc_scope(tag) && dwarf_haspc(&cur, pc) == 1) {
      if (is_function(tag)) chain.push_back(cur);
      if (chain.size() > kMaxDepth) break;
      resume.clear();  // committed to this subtree
      Dwarf_Die child;
      Dwarf_Die parent = cur;
      rc = dwarf_child(&parent, &child);
      if (rc == 0) cur = child;
      else break;  // innermost scope reached
      continue;
    }
    if (is_container(tag) && dwarf_haschildren(&cur) == 1 && resume.size() < kMaxDepth) {
      Dwarf_Die child;
      if (dwarf_child(&cur, &child) == 0) {
        resume.push_back(cur);
        cur = child;
        rc = 0;
        continue;
      }
    }
    Dwarf_Off o = dwarf_dieoffset(&cur);
    Dwarf_Die sib;
    rc = dwarf_siblingof(&cur, &sib);
    if (rc == 0) {
      if (dwarf_dieoffset(&sib) <= o) break;  // a loop in hostile DWARF
      cur = sib;
    }
  }
  return chain;
}

}  // namespace

DwarfIndex::~DwarfIndex() {
  if (dw_) dwarf_end(dw_);
}

std::unique_ptr<DwarfIndex> DwarfIndex::create(const ElfImage& img) {
  if (!img.has_dwarf() || !img.compressed_sections_sane()) return nullptr;
  Dwarf* dw = dwarf_begin_elf(img.elf(), DWARF_C_READ, nullptr);
  if (!dw) return nullptr;
  std::unique_ptr<DwarfIndex> idx(new DwarfIndex());
  idx->dw_ = dw;
  Dwarf_CU* cu = nullptr;
  Dwarf_Die cudie;
  uint8_t unit_type = 0;
  Dwarf_Half version = 0;
  while (dwarf_get_units(dw, cu, &cu, &version, &unit_type, &cudie, nullptr) == 0) {
    if (unit_type != DW_UT_compile && unit_type != DW_UT_skeleton) continue;
    ++idx->cu_count_;
    Dwarf_Addr base, lo, hi;
    ptrdiff_t off = 0;
    size_t per_cu = 0;
    while ((off = dwarf_ranges(&cudie, off, &base, &lo, &hi)) > 0) {
      if (hi > lo) idx->ranges_.push_back({lo, hi, dwarf_dieoffset(&cudie)});
      if (++per_cu > 1'000'000 || idx->ranges_.size() > kMaxRanges) break;
    }
    if (idx->ranges_.size() > kMaxRanges) break;
  }
  std::sort(idx->ranges_.begin(), idx->ranges_.end(),
            [](const CuRange& a, const CuRange& b) { return a.lo < b.lo; });
  if (idx->ranges_.empty()) return nullptr;
  return idx;
}

bool DwarfIndex::lookup(uint64_t vaddr, std::vector<DwarfFrame>& out) {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), vaddr,
                             [](uint64_t v, const CuRange& r) { return v < r.lo; });
  const CuRange* hit = nullptr;
  for (int steps = 0; steps < 64 && it != ranges_.begin(); ++steps) {
    --it;
    if (vaddr < it->hi) {
      hit = &*it;
      break;
    }
  }
  if (!hit) return false;
  Dwarf_Die cudie;
  if (!dwarf_offdie(dw_, hit->cu_die, &cudie)) return false;

  DwarfFrame inner;
  if (Dwarf_Line* line = dwarf_getsrc_die(&cudie, vaddr)) {
    if (const char* src = dwarf_linesrc(line, nullptr, nullptr)) inner.file = src;
    int l = 0, c = 0;
    dwarf_lineno(line, &l);
    dwarf_linecol(line, &c);
    inner.line = l;
    inner.column = c;
  }

  std::vector<Dwarf_Die> chain = function_chain(&cudie, vaddr);
  if (chain.empty()) {
    out.push_back(std::move(inner));
    return true;
  }
  Dwarf_Files* files = nullptr;
  size_t nfiles = 0;
  if (dwarf_getsrcfiles(&cudie, &files, &nfiles) != 0) files = nullptr;

  DwarfFrame loc = std::move(inner);  // location of the frame being emitted
  for (size_t i = chain.size(); i-- > 0;) {
    Dwarf_Die* die = &chain[i];
    DwarfFrame f;
    if (const char* n = die_name(die, f.linkage)) f.name = n;
    f.file = std::move(loc.file);
    f.line = loc.line;
    f.column = loc.column;
    const bool inlined = dwarf_tag(die) == DW_TAG_inlined_subroutine;
    f.inlined = inlined;
    Dwarf_Addr entry = 0;
    if (dwarf_entrypc(die, &entry) == 0) f.entry = entry;
    out.push_back(std::move(f));
    // The caller's location is where this instance was inlined.
    loc = DwarfFrame{};
    if (inlined) {
      Dwarf_Attribute a;
      Dwarf_Word idx;
      if (files && dwarf_formudata(dwarf_attr(die, DW_AT_call_file, &a), &idx) == 0 && idx < nfiles) {
        if (const char* src = dwarf_filesrc(files, idx, nullptr, nullptr)) loc.file = src;
      }
      loc.line = attr_int(die, DW_AT_call_line);
      loc.column = attr_int(die, DW_AT_call_column);
    } else {
      break;  // a real (out-of-line) function ends the chain
    }
  }
  return true;
}

}  // namespace memtrace::symbolize
