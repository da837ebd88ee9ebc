// Which allocator an ELF object provides, and where to probe each of its entry
// points (role, symbol, placement). Used by the loader for --explain-probes,
// per-process attach, and the -O/-S style options (object, symbol prefix).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "elf/elf_file.h"
#include "probes/probe_placement.h"

namespace memtrace::probes {

// Same order as MT_ROLE_* in bpf/memtrace.h.
enum class Role : uint32_t {
  kMalloc = 0,
  kCalloc,
  kRealloc,
  kReallocarray,
  kFree,
  kPosixMemalign,
  kAlignedAlloc,
  kMemalign,
  kValloc,
  kPvalloc,
  kCount,
};
const char* role_name(Role r);  // "malloc", "calloc", ...
// Arguments the memtrace BPF program reads for a role (free: ptr; calloc:
// nmemb, size; posix_memalign: memptr, -, size; ...), plus [rsp] and rbp.
Needs needs_for(Role r);
// Every role but free has a return probe.
inline bool has_return_probe(Role r) { return r != Role::kFree; }

enum class Family { kNone, kGlibc, kJemalloc, kTcmalloc, kMimalloc, kOther };
const char* family_name(Family f);

struct AllocatorSymbol {
  Role role = Role::kMalloc;
  std::string symbol;        // as found: "malloc", "je_malloc", "tc_malloc" ...
  uint64_t vaddr = 0;        // st_value
  uint64_t size = 0;         // st_size
  uint64_t file_offset = 0;  // of vaddr, for the uprobe
  std::string alias_of;      // non-empty: another role's symbol at the same address;
                             // attach nothing for this one (the probe there fires once)
  Placement placement;       // where the entry probe goes (offset from vaddr)
};

struct Allocator {
  Family family = Family::kNone;
  std::string prefix;  // symbol prefix used ("" for plain malloc/free)
  std::vector<AllocatorSymbol> symbols;  // roles found, in Role order
  const AllocatorSymbol* find(Role r) const;
};

struct DetectOptions {
  // bcc memleak -S: look up PREFIX + "malloc" etc. and nothing else.
  std::optional<std::string> symbol_prefix;
  KernelCaps caps = KernelCaps::running();
  // Check the whole object for rel32 branches into each chosen entry path
  // (conservative; a few ms for libc).
  bool scan_object = true;
};

// The allocator family of an object from its symbol table:
//   glibc:    malloc + free + __libc_malloc
//   jemalloc: mallocx / je_mallocx / je_malloc (or malloc_conf object)
//   tcmalloc: tc_malloc
//   mimalloc: mi_malloc
//   other:    malloc + free only (a custom allocator, or a static binary)
Family detect_family(const elf::ElfFile& elf);

// Roles to probe in elf: plain names if it defines malloc and free, else the
// family's prefix (je_, tc_, mi_), or exactly options.symbol_prefix when given.
// nullopt if the object provides no malloc/free pair. IFUNC symbols are skipped.
std::optional<Allocator> find_allocator_symbols(const elf::ElfFile& elf, const DetectOptions& opts = {});

// Offsets (from entry) in [1, len] of the function at vaddr that some rel32
// jmp/call/jcc anywhere in the object's executable segments targets (byte
// pattern scan: may over-report, never under-reports rel32 branches).
std::vector<uint64_t> incoming_branch_targets(const elf::ElfFile& elf, uint64_t vaddr, uint64_t len);

// Placement for one function symbol: reads the whole function (size, at most
// 64 KiB) and optionally scans the object for branches into its entry path.
Placement place_function(const elf::ElfFile& elf, const elf::Symbol& sym, const Needs& needs,
                         const KernelCaps& caps = KernelCaps::running(), bool scan_object = true);

// --explain-probes block for an object: one line per role.
std::string explain(const Allocator& a, const std::string& object_path);

}  // namespace memtrace::probes
