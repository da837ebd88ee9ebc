#include "probes/allocators.h"

#include <elf.h>

#include <cstring>
#include <map>
#include <sstream>

namespace memtrace::probes {

const char* role_name(Role r) {
  static const char* names[] = {"malloc",         "calloc",        "realloc",  "reallocarray",
                                "free",           "posix_memalign", "aligned_alloc",
                                "memalign",       "valloc",        "pvalloc",  "aligned_new",
                                "PyObject_Malloc", "PyObject_Calloc", "PyObject_Realloc", "PyObject_Free"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(Role::kCount));
  auto i = static_cast<uint32_t>(r);
  return i < static_cast<uint32_t>(Role::kCount) ? names[i] : "?";
}

Needs needs_for(Role r) {
  Needs n;
  switch (r) {
    case Role::kFree: n.arg_mask = 0x1; break;           // ptr
    case Role::kCalloc: n.arg_mask = 0x3; break;         // nmemb, size
    case Role::kRealloc: n.arg_mask = 0x3; break;        // ptr, size
    case Role::kReallocarray: n.arg_mask = 0x7; break;   // ptr, nmemb, size
    case Role::kPosixMemalign: n.arg_mask = 0x5; break;  // memptr, (alignment), size
    case Role::kAlignedAlloc:
    case Role::kMemalign: n.arg_mask = 0x2; break;       // (alignment), size
    case Role::kPyMalloc: n.arg_mask = 0x3; break;       // ctx, size
    case Role::kPyFree: n.arg_mask = 0x3; break;         // ctx, ptr
    case Role::kPyCalloc:
    case Role::kPyRealloc: n.arg_mask = 0x7; break;      // ctx, nelem/ptr, size
    default: n.arg_mask = 0x1; break;                    // size
  }
  n.reads_rsp = true;
  n.reads_rbp = r != Role::kAlignedNew;  // no stack taken there
  n.return_probe = has_return_probe(r);
  return n;
}

const char* family_name(Family f) {
  switch (f) {
    case Family::kNone: return "none";
    case Family::kGlibc: return "glibc";
    case Family::kJemalloc: return "jemalloc";
    case Family::kTcmalloc: return "tcmalloc";
    case Family::kMimalloc: return "mimalloc";
    case Family::kOther: return "other";
    case Family::kCxx: return "c++";
  }
  return "?";
}

const AllocatorSymbol* Allocator::find(Role r) const {
  for (const auto& s : symbols)
    if (s.role == r) return &s;
  return nullptr;
}

namespace {

std::optional<elf::Symbol> probeable(const elf::ElfFile& elf, const std::string& name) {
  auto s = elf.find_function(name);
  if (!s || s->type == STT_GNU_IFUNC || s->vaddr == 0) return std::nullopt;
  return s;
}

const char* family_prefix(Family f) {
  switch (f) {
    case Family::kJemalloc: return "je_";
    case Family::kTcmalloc: return "tc_";
    case Family::kMimalloc: return "mi_";
    default: return "";
  }
}

}  // namespace

Family detect_family(const elf::ElfFile& elf) {
  auto has = [&](const char* n) { return probeable(elf, n).has_value(); };
  if (has("mi_malloc")) return Family::kMimalloc;
  if (has("tc_malloc")) return Family::kTcmalloc;
  if (has("je_malloc") || has("je_mallocx") || has("mallocx")) return Family::kJemalloc;
  if (has("malloc") && has("free")) return has("__libc_malloc") ? Family::kGlibc : Family::kOther;
  return Family::kNone;
}

std::vector<uint64_t> incoming_branch_targets(const elf::ElfFile& elf, uint64_t vaddr, uint64_t len, Isa isa) {
  std::vector<uint64_t> out;
  if (isa == Isa::kArm64) {  // b, bl, b.cond, cbz/cbnz, tbz/tbnz: every aligned word of the code
    for (const auto& seg : elf.segments()) {
      if (!(seg.flags & PF_X) || seg.filesz < 4) continue;
      for (uint64_t t : arm64_branch_targets(elf.read_vaddr(seg.vaddr, seg.filesz), seg.vaddr, vaddr + 1,
                                             vaddr + len + 1))
        out.push_back(t - vaddr);
    }
    return out;
  }
  for (const auto& seg : elf.segments()) {
    if (!(seg.flags & PF_X) || seg.filesz < 5) continue;
    std::vector<uint8_t> b = elf.read_vaddr(seg.vaddr, seg.filesz);
    for (size_t p = 0; p + 5 <= b.size(); p++) {
      size_t ilen;
      if (b[p] == 0xe8 || b[p] == 0xe9) {
        ilen = 5;
      } else if (b[p] == 0x0f && p + 6 <= b.size() && b[p + 1] >= 0x80 && b[p + 1] <= 0x8f) {
        ilen = 6;
      } else {
        continue;
      }
      int32_t rel;
      std::memcpy(&rel, &b[p + ilen - 4], 4);
      uint64_t target = seg.vaddr + p + ilen + static_cast<int64_t>(rel);
      if (target > vaddr && target <= vaddr + len) out.push_back(target - vaddr);
    }
  }
  return out;
}

Placement place_function(const elf::ElfFile& elf, const elf::Symbol& sym, const Needs& needs,
                         const KernelCaps& caps, bool scan_object, Isa isa) {
  const uint64_t kMax = 64 * 1024;
  uint64_t len = sym.size ? std::min<uint64_t>(sym.size, kMax) : 64;
  PlaceOptions o;
  o.caps = caps;
  o.isa = isa;
  o.whole_function = sym.size != 0 && sym.size <= kMax;
  std::vector<uint8_t> code = elf.read_vaddr(sym.vaddr, len);
  // First pass tells how long the entry path is; only then scan the object
  // for branches into it (the scan is the slow part).
  Placement p = choose_entry_offset(code, sym.vaddr, needs, o);
  if (scan_object && p.offset > 0) {
    o.incoming_targets = incoming_branch_targets(elf, sym.vaddr, p.offset, isa);
    if (!o.incoming_targets.empty()) {
      p = choose_entry_offset(code, sym.vaddr, needs, o);
    } else {
      p.reason += std::string(isa == Isa::kArm64 ? "; no direct branch in the object targets the entry path" : "; no rel32 branch in the object targets the entry path");
    }
  }
  return p;
}

std::optional<Allocator> find_allocator_symbols(const elf::ElfFile& elf, const DetectOptions& opts) {
  Allocator a;
  a.family = detect_family(elf);
  if (opts.symbol_prefix) {
    a.prefix = *opts.symbol_prefix;
  } else if (probeable(elf, "malloc") && probeable(elf, "free")) {
    a.prefix = "";
  } else {
    a.prefix = family_prefix(a.family);
  }
  if (!probeable(elf, a.prefix + "malloc") || !probeable(elf, a.prefix + "free")) return std::nullopt;
  if (a.family == Family::kNone) a.family = Family::kOther;

  // Roles sharing an address: one probe, with the union of what they read.
  std::map<uint64_t, Needs> needs_at;
  std::vector<std::pair<Role, elf::Symbol>> found;
  for (uint32_t i = 0; i <= static_cast<uint32_t>(Role::kPvalloc); i++) {  // the malloc family
    Role r = static_cast<Role>(i);
    auto s = probeable(elf, a.prefix + role_name(r));
    if (!s) continue;
    found.emplace_back(r, *s);
    Needs n = needs_for(r);
    auto [it, fresh] = needs_at.emplace(s->vaddr, n);
    if (!fresh) {
      it->second.arg_mask |= n.arg_mask;
      it->second.reads_rsp |= n.reads_rsp;
      it->second.reads_rbp |= n.reads_rbp;
      it->second.return_probe |= n.return_probe;
    }
  }
  std::map<uint64_t, std::string> first_at;
  for (auto& [r, s] : found) {
    AllocatorSymbol as;
    as.role = r;
    as.symbol = s.name;
    as.vaddr = s.vaddr;
    as.size = s.size;
    as.file_offset = s.file_offset;
    auto [it, fresh] = first_at.emplace(s.vaddr, s.name);
    if (!fresh) {
      as.alias_of = it->second;
      for (const auto& prev : a.symbols)
        if (prev.vaddr == s.vaddr) as.placement = prev.placement;
    } else {
      as.placement = place_function(elf, s, needs_at[s.vaddr], opts.caps, opts.scan_object, opts.isa);
    }
    a.symbols.push_back(std::move(as));
  }
  if (a.family != Family::kGlibc) {
    static const char* const kNew[] = {"_Znwm", "_Znam", "_ZnwmRKSt9nothrow_t", "_ZnamRKSt9nothrow_t",
                                       "_ZnwmSt11align_val_t", "_ZnamSt11align_val_t",
                                       "_ZnwmSt11align_val_tRKSt9nothrow_t", "_ZnamSt11align_val_tRKSt9nothrow_t"};
    static const char* const kDelete[] = {"_ZdlPv", "_ZdaPv", "_ZdlPvRKSt9nothrow_t", "_ZdaPvRKSt9nothrow_t",
                                          "_ZdlPvm", "_ZdaPvm", "_ZdlPvSt11align_val_t", "_ZdaPvSt11align_val_t",
                                          "_ZdlPvSt11align_val_tRKSt9nothrow_t",
                                          "_ZdaPvSt11align_val_tRKSt9nothrow_t", "_ZdlPvmSt11align_val_t",
                                          "_ZdaPvmSt11align_val_t"};
    // Placed as their role's functions, for the BPF path's probes; one at
    // the address of an earlier function is its alias (new and new[] are
    // one function in tcmalloc): not probed twice.
    auto extra = [&](const std::string& name, Role r) {
      auto s = probeable(elf, name);
      if (!s) return;
      AllocatorSymbol as;
      as.role = r;
      as.symbol = s->name;
      as.vaddr = s->vaddr;
      as.size = s->size;
      as.file_offset = s->file_offset;
      auto [it, fresh] = first_at.emplace(s->vaddr, s->name);
      if (!fresh) {
        as.alias_of = it->second;
        for (const auto* list : {&a.symbols, &a.extras})
          for (const auto& prev : *list)
            if (prev.vaddr == s->vaddr && prev.alias_of.empty()) as.placement = prev.placement;
      } else {
        as.placement = place_function(elf, *s, needs_for(r), opts.caps, opts.scan_object, opts.isa);
      }
      a.extras.push_back(std::move(as));
    };
    for (const char* n : kNew) extra(n, Role::kMalloc);
    for (const char* n : kDelete) extra(n, Role::kFree);
    extra(a.prefix + "mallocx", Role::kMalloc);
    extra(a.prefix + "rallocx", Role::kRealloc);
    extra(a.prefix + "sdallocx", Role::kFree);
    extra(a.prefix + "dallocx", Role::kFree);
  }
  return a;
}

std::optional<Allocator> find_cxx_aligned_new(const elf::ElfFile& elf, const DetectOptions& opts,
                                              std::string* why_not) {
  static const char* const kSymbols[] = {"_ZnwmSt11align_val_t", "_ZnamSt11align_val_t",
                                         "_ZnwmSt11align_val_tRKSt9nothrow_t",
                                         "_ZnamSt11align_val_tRKSt9nothrow_t"};
  auto no = [&](std::string why) -> std::optional<Allocator> {
    if (why_not) *why_not = std::move(why);
    return std::nullopt;
  };
  if (!probeable(elf, kSymbols[0])) return no("no aligned operator new (_ZnwmSt11align_val_t)");
  switch (detect_family(elf)) {
    case Family::kJemalloc:  // passes the size to aligned_alloc unchanged
    case Family::kTcmalloc:  // allocate internally: neither calls a probed
    case Family::kMimalloc:  // entry point with the size rounded
      return no("an allocator's own operator new (" + std::string(family_name(detect_family(elf))) +
                "): it does not round the size for aligned_alloc");
    default: break;
  }
  if (!elf.imports("aligned_alloc") && !probeable(elf, "aligned_alloc"))
    return no("its aligned operator new does not call aligned_alloc (posix_memalign: the size is passed on unchanged)");
  Allocator a;
  a.family = Family::kCxx;
  std::map<uint64_t, std::string> first_at;
  for (const char* name : kSymbols) {
    auto s = probeable(elf, name);
    if (!s) continue;
    AllocatorSymbol as;
    as.role = Role::kAlignedNew;
    as.symbol = s->name;
    as.vaddr = s->vaddr;
    as.size = s->size;
    as.file_offset = s->file_offset;
    auto [it, fresh] = first_at.emplace(s->vaddr, s->name);
    if (!fresh) {
      as.alias_of = it->second;
      for (const auto& prev : a.symbols)
        if (prev.vaddr == s->vaddr) as.placement = prev.placement;
    } else {
      as.placement = place_function(elf, *s, needs_for(Role::kAlignedNew), opts.caps, opts.scan_object, opts.isa);
    }
    a.symbols.push_back(std::move(as));
  }
  return a;
}

std::string explain(const Allocator& a, const std::string& object_path) {
  std::ostringstream os;
  if (a.family == Family::kCxx)
    os << object_path << ": C++ aligned operator new (rounds the size up before aligned_alloc): entry probes "
       << "only, for the size the program asked for (no return probe: a C++ exception thrown through one "
       << "aborts the program)\n";
  else
    os << object_path << ": " << family_name(a.family) << " allocator"
       << (a.prefix.empty() ? "" : " (symbol prefix " + a.prefix + ")") << "\n";
  auto line = [&](const AllocatorSymbol& s) {
    os << "  " << role_name(s.role) << "  " << s.symbol;
    if (!s.alias_of.empty()) {
      os << ": alias of " << s.alias_of << " (same address, one probe)\n";
      return;
    }
    os << describe(s.placement) << "\n";
  };
  // Then its other entries (C++ new/delete, mallocx...), probed as the role shown.
  for (const auto* list : {&a.symbols, &a.extras})
    for (const auto& s : *list) line(s);
  return os.str();
}

}  // namespace memtrace::probes
