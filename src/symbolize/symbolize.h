// src/symbolize: address -> function (file:line), inlines, like a debugger.
// Self-contained: nothing BPF in here. The loader captures a process's
// mappings while it lives (AddressSpace::update), and symbolizes stacks when it
// prints a report, possibly after the process has exited.
//
// CONTRACT with the loader (keep these names; add freely).
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/result.h"
#include "procfs/proc_maps.h"

namespace memtrace::symbolize {

using MappingInfo = procfs::Mapping;  // one line of /proc/PID/maps (src/procfs)

struct Frame {
  std::string function;  // demangled; "" if unknown
  uint64_t offset = 0;   // address - symbol start
  std::string module;    // path of the mapped object
  std::string file;      // source file, "" if unknown
  int line = 0;
  int column = 0;
  bool inlined = false;  // true for frames inlined into the next (outer) one
};

enum class Unknown {
  None = 0,
  Unmapped,    // address not inside any known mapping
  NoSymbols,   // module has no symbol covering the address
  FileGone,    // module file could not be opened
  BadFile,     // module file is not a valid ELF (truncated, corrupt)
  Anonymous,   // executable memory with no file behind it (JIT, [vdso] not readable)
};
const char* to_string(Unknown);
// "function+0xoff (file:line:col)", "[inlined] " prefix for inlined frames.
std::string to_string(const Frame&);

struct Symbolized {
  uint64_t address = 0;
  std::vector<Frame> frames;  // innermost first; empty when unknown != None
  Unknown unknown = Unknown::None;
  std::string module;         // module even when unknown (if mapped)
  uint64_t module_offset = 0; // file offset of address in module
};

struct Options {
  std::vector<std::string> symbol_dirs;     // --symbols DIR: searched first, matched by build-id
  std::string debug_root = "/usr/lib/debug";
  bool demangle = true;
  bool dwarf = true;                        // false: ELF symbols only
  bool use_map_files = true;                // false: only /proc/PID/root/PATH (tests)
  // Debug files missing locally are asked of DEBUGINFOD_URLS (debuginfod.h;
  // the CLI's --no-debuginfod turns it off process-wide).
  bool debuginfod = true;
  // Ask debuginfod only once allow_debuginfod() is called: a live trace's
  // drain thread symbolizes for --interval, --trace and the console, and a
  // download (seconds) there would stall draining. Its final report asks.
  bool defer_debuginfod = false;
};

class Symbolizer;

// "" when every dir is a readable directory, else one line naming the first
// that is not ("--symbols /x: No such file or directory").
std::string check_symbol_dirs(const std::vector<std::string>& dirs);

// The mappings of one process over time (mappings are added, never dropped:
// a library unmapped before the report still symbolizes its old addresses).
class AddressSpace {
 public:
  AddressSpace();
  ~AddressSpace();
  AddressSpace(AddressSpace&&) noexcept;
  AddressSpace& operator=(AddressSpace&&) noexcept;
  pid_t pid() const;
  size_t mapping_count() const;
  struct Impl;
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }
 private:
  std::unique_ptr<Impl> impl_;
};

class Symbolizer {
 public:
  explicit Symbolizer(Options opts = {});
  ~Symbolizer();
  Symbolizer(const Symbolizer&) = delete;
  Symbolizer& operator=(const Symbolizer&) = delete;

  // Read /proc/PID/maps and open every file-backed executable mapping through
  // /proc/PID/map_files or /proc/PID/root while the process lives. Calling it
  // again adds what appeared since. Files are parsed once per run (shared by
  // build-id / dev+inode across processes).
  // maps: /proc/PID/maps as read by the caller (nullptr: read it here).
  Result<void> update(AddressSpace& as, pid_t pid, const std::vector<MappingInfo>* maps = nullptr);

  // Add one mapping by hand (tests, fuzzer, recordings): open_path is the file
  // to read for it.
  void add_mapping(AddressSpace& as, const MappingInfo& m, const std::string& open_path);

  // Map a whole ELF file as the dynamic loader would, at load bias `bias`
  // (runtime address = ELF vaddr + bias): one mapping per PT_LOAD. With
  // bias 0, addresses are the file's own vaddrs, as addr2line takes them.
  Result<void> add_file(AddressSpace& as, const std::string& path, uint64_t bias = 0);

  // return_address: look up address-1 (non-leaf frames), so the line is the call's.
  // Memoized per (module, address). The reference stays valid until the next
  // update/add_mapping on `as` (or its destruction). Not thread-safe.
  const Symbolized& symbolize(const AddressSpace& as, uint64_t address, bool return_address);

  // ---- Locations: an address as (file, offset), valid after the process is
  // gone and the same in every process that maps the file (the heap model's
  // sealed stacks). Module ids are numbered here from 1: one per file as
  // mapped at a path, one per reason nothing is known.
  // Every mapping of as as a range of addresses whose location is (module,
  // address - bias); sorted, not overlapping. unmapped_module(): the id of
  // an address in no mapping.
  struct LocationRange {
    uint64_t start = 0, end = 0;
    uint32_t module = 0;
    uint64_t bias = 0;
  };
  std::vector<LocationRange> location_ranges(const AddressSpace& as);
  uint32_t unmapped_module();
  // Executable memory with no file (a JIT's code): the module of such a
  // mapping (anonymous_module(): of one with no name), whose locations a
  // JIT's process keeps as addresses (bias 0), named from its perf map.
  uint32_t anonymous_module();
  bool is_anonymous_module(uint32_t module) const;
  // What symbolize(as, address, return_address) said, from a location; the
  // result's address is 0. Memoized per (module, offset); valid until the
  // next call.
  const Symbolized& symbolize_at(uint32_t module, uint64_t offset, bool return_address);

  // Could address be a return address of a stack of as (call_site.h)?
  // false: in no mapping of as, or the bytes before it in its file are no
  // call; true where they cannot be read (a file gone, anonymous memory).
  bool follows_call(const AddressSpace& as, uint64_t address);
  // The same for a location (module id, file offset): false for
  // unmapped_module().
  bool follows_call_at(uint32_t module, uint64_t offset);
  // as has executable memory with no file behind it (a JIT's code): an
  // address in no mapping of it may be code made since it was read.
  bool has_anonymous_code(const AddressSpace& as) const;

  // From now on, debug files missing locally are asked of debuginfod (when
  // Options::debuginfod): modules read without it while deferred are read
  // again on their next lookup, and earlier results are forgotten.
  void allow_debuginfod();

  // Introspection (tests, --verbose).
  struct Stats {
    size_t files_opened = 0;   // ELF files parsed (each at most once per dev+inode / build-id)
    size_t modules = 0;        // distinct modules
    size_t lookups = 0;        // symbolize() calls
    size_t module_lookups = 0; // lookups that reached a module's memo or DWARF
  };
  Stats stats() const;
  // Separate debug file used for the module mapped at address, "" if none.
  std::string debug_file(const AddressSpace& as, uint64_t address);

  struct Impl;
 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtrace::symbolize
