#include "symbolize/dwarf_index.h"

#include <dwarf.h>

#include <algorithm>
#include <set>

#include "elf/image.h"

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

}  // namespace

DwarfIndex::~DwarfIndex() {
  if (dw_) dwarf_end(dw_);
}

std::unique_ptr<DwarfIndex> DwarfIndex::create(const elf::Image& img) {
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

const DwarfIndex::CuFunctions& DwarfIndex::functions_of(Dwarf_Die* cudie) {
  Dwarf_Off key = dwarf_dieoffset(cudie);
  if (auto it = cu_functions_.find(key); it != cu_functions_.end()) return it->second;
  CuFunctions& cf = cu_functions_[key];
  struct Node {
    uint64_t lo, hi;
    int32_t scope;
    uint32_t depth;
  };
  std::vector<Node> nodes;
  // Iterative walk of the whole CU: (die, enclosing function scope, depth).
  struct Level {
    Dwarf_Die die;
    int32_t scope;
  };
  std::vector<Level> stack;
  Dwarf_Die child;
  if (dwarf_child(cudie, &child) == 0) stack.push_back({child, -1});
  size_t visits = 0;
  while (!stack.empty() && visits++ < kMaxVisits) {
    Level& top = stack.back();
    Dwarf_Die cur = top.die;
    int32_t scope = top.scope;
    // Advance this level to the next sibling now (forward only: hostile loops).
    Dwarf_Off o = dwarf_dieoffset(&cur);
    Dwarf_Die sib;
    int rc = dwarf_siblingof(&cur, &sib);
    if (rc == 0 && dwarf_dieoffset(&sib) > o) top.die = sib;
    else stack.pop_back();

    int tag = dwarf_tag(&cur);
    int32_t inner = scope;
    if (is_function(tag) && cf.scopes.size() < INT32_MAX) {
      Dwarf_Addr base, lo, hi;
      ptrdiff_t off = 0;
      int32_t idx = -1;
      for (int n = 0; n < 4096 && (off = dwarf_ranges(&cur, off, &base, &lo, &hi)) > 0; ++n) {
        if (hi <= lo) continue;
        if (idx < 0) {
          idx = static_cast<int32_t>(cf.scopes.size());
          cf.scopes.push_back({o, scope});
        }
        nodes.push_back({lo, hi, idx, static_cast<uint32_t>(stack.size())});
      }
      if (idx >= 0) inner = idx;
    }
    if ((is_pc_scope(tag) || is_container(tag)) && stack.size() < kMaxDepth && dwarf_haschildren(&cur) == 1 &&
        dwarf_child(&cur, &child) == 0)
      stack.push_back({child, inner});
  }
  // Flatten into disjoint segments, each naming the deepest scope covering
  // it (ranges of one scope need not nest inside one range of its parent).
  std::vector<uint32_t> depth(cf.scopes.size(), 0);
  for (size_t i = 0; i < cf.scopes.size(); ++i) {
    int32_t p = cf.scopes[i].parent;
    depth[i] = (p >= 0 && static_cast<size_t>(p) < i) ? depth[static_cast<size_t>(p)] + 1 : 0;
  }
  struct Event {
    uint64_t pos;
    bool open;
    int32_t scope;
  };
  std::vector<Event> ev;
  ev.reserve(nodes.size() * 2);
  for (const Node& n : nodes) {
    ev.push_back({n.lo, true, n.scope});
    ev.push_back({n.hi, false, n.scope});
  }
  std::sort(ev.begin(), ev.end(), [](const Event& a, const Event& b) { return a.pos < b.pos; });
  std::multiset<std::pair<uint32_t, int32_t>> active;  // (depth, scope)
  for (size_t i = 0; i < ev.size();) {
    uint64_t pos = ev[i].pos;
    for (; i < ev.size() && ev[i].pos == pos; ++i) {
      auto key = std::make_pair(depth[static_cast<size_t>(ev[i].scope)], ev[i].scope);
      if (ev[i].open) active.insert(key);
      else if (auto it = active.find(key); it != active.end()) active.erase(it);
    }
    int32_t top = active.empty() ? -1 : active.rbegin()->second;
    if (cf.segments.empty() || cf.segments.back().second != top) cf.segments.emplace_back(pos, top);
  }
  return cf;
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

  // Function scopes containing vaddr, outermost first.
  std::vector<Dwarf_Die> chain;
  const CuFunctions& cf = functions_of(&cudie);
  auto seg = std::upper_bound(cf.segments.begin(), cf.segments.end(), vaddr,
                              [](uint64_t v, const std::pair<uint64_t, int32_t>& s) { return v < s.first; });
  if (seg != cf.segments.begin()) {
    int32_t sc = std::prev(seg)->second;
    for (size_t n = 0; sc >= 0 && static_cast<size_t>(sc) < cf.scopes.size() && n < kMaxDepth; ++n) {
      Dwarf_Die d;
      if (!dwarf_offdie(dw_, cf.scopes[static_cast<size_t>(sc)].die, &d)) break;
      chain.push_back(d);
      sc = cf.scopes[static_cast<size_t>(sc)].parent;
    }
    std::reverse(chain.begin(), chain.end());
  }
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
