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
  // C++ aligned operator new (new, new[] and their nothrow forms): an entry
  // probe that leaves the size the program asked for to the aligned call it
  // makes (bpf/memtrace.h MT_ROLE_ALIGNED_NEW). Not a malloc-family role:
  // find_cxx_aligned_new finds its symbols.
  kAlignedNew,
  // CPython's pymalloc functions, the python domain (bpf/memtrace.h
  // MT_ROLE_PY_*): ctx first. Found by src/python/pymem.h, not here.
  kPyMalloc,
  kPyCalloc,
  kPyRealloc,
  kPyFree,
  kCount,
};
const char* role_name(Role r);  // "malloc", "calloc", ...
// Arguments the memtrace BPF program reads for a role (free: ptr; calloc:
// nmemb, size; posix_memalign: memptr, -, size; ...), plus [rsp] and rbp.
Needs needs_for(Role r);
// Every role but free and aligned new has a return probe (aligned new: a C++
// exception thrown through a uretprobe'd frame finds the kernel's trampoline
// as its return address, no unwind info there, and calls std::terminate).
inline bool has_return_probe(Role r) { return r != Role::kFree && r != Role::kAlignedNew && r != Role::kPyFree; }

// kCxx: not an allocator, a C++ runtime whose aligned operator new is probed
// (find_cxx_aligned_new).
enum class Family { kNone, kGlibc, kJemalloc, kTcmalloc, kMimalloc, kOther, kCxx };
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
  // Its other entry points (not glibc's: it has none), each with the role
  // of what it does: C++ operator new and new[] (plain, nothrow, aligned:
  // kMalloc, the size first), operator delete and delete[] (plain, sized,
  // aligned, nothrow: kFree, the pointer first), jemalloc's mallocx
  // (kMalloc), rallocx (kRealloc), sdallocx and dallocx (kFree), with the
  // family's prefix. Under a preloaded tcmalloc or mimalloc the program's
  // new and delete are these, not libstdc++'s (which call malloc and
  // free). Placed (and aliased) as the role's functions: the BPF path
  // probes them too; --inject patches them (src/inject).
  std::vector<AllocatorSymbol> extras;
  const AllocatorSymbol* find(Role r) const;
};

struct DetectOptions {
  // bcc memleak -S: look up PREFIX + "malloc" etc. and nothing else.
  std::optional<std::string> symbol_prefix;
  KernelCaps caps = KernelCaps::running();
  // Check the whole object for rel32 branches into each chosen entry path
  // (conservative; a few ms for libc).
  bool scan_object = true;
  Isa isa = kHostIsa;  // of the object's code (tests: arm64 libc on an x86-64 host)
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

// The C++ aligned operator new family of an object (libstdc++, libc++ or
// libc++abi, or a program with one linked in): _ZnwmSt11align_val_t,
// _ZnamSt11align_val_t and their nothrow_t forms, role kAlignedNew, family
// kCxx. Only where that operator new rounds the size up before it calls the
// allocator, which is what calling aligned_alloc means (C11 wants the size a
// multiple of the alignment): the object must import or define
// aligned_alloc. libstdc++ does (size rounded up to the alignment); Debian
// 12's libc++abi (LLVM 14) calls posix_memalign with the size unchanged and
// is left alone; newer libc++ rounds for aligned_alloc too. jemalloc,
// tcmalloc and mimalloc define their own aligned operator new, which does not
// round the size for aligned_alloc: left alone too. The plain
// operator new passes the size on unchanged (0 becomes 1): not probed.
// nullopt if there is nothing to probe; *why_not says why when given.
std::optional<Allocator> find_cxx_aligned_new(const elf::ElfFile& elf, const DetectOptions& opts = {},
                                              std::string* why_not = nullptr);

// Offsets (from entry) in [1, len] of the function at vaddr that some rel32
// jmp/call/jcc anywhere in the object's executable segments targets (byte
// pattern scan: may over-report, never under-reports rel32 branches). arm64:
// the direct branches (b, bl, b.cond, cbz/cbnz, tbz/tbnz) of every aligned word.
std::vector<uint64_t> incoming_branch_targets(const elf::ElfFile& elf, uint64_t vaddr, uint64_t len,
                                              Isa isa = kHostIsa);

// Placement for one function symbol: reads the whole function (size, at most
// 64 KiB) and optionally scans the object for branches into its entry path.
Placement place_function(const elf::ElfFile& elf, const elf::Symbol& sym, const Needs& needs,
                         const KernelCaps& caps = KernelCaps::running(), bool scan_object = true,
                         Isa isa = kHostIsa);

// --explain-probes block for an object: one line per role.
std::string explain(const Allocator& a, const std::string& object_path);

}  // namespace memtrace::probes
