// One ELF module (an executable or shared object) as the symbolizer sees it:
// its image, the separate debug file if any, its symbols and DWARF index,
// loaded on first lookup, and the memo of lookups by link-time vaddr.
// Shared by every mapping of the same file, across processes.
#pragma once
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "symbolize/debug_finder.h"
#include "symbolize/dwarf_index.h"
#include "symbolize/symbol_table.h"
#include "elf/image.h"
#include "symbolize/symbolize.h"

namespace memtrace::symbolize {

struct ModuleLookup {
  Unknown unknown = Unknown::None;
  std::vector<Frame> frames;  // module field left empty: the mapping fills it
};

class Module {
 public:
  // dir / logical_dir: see DebugFinder::find.
  Module(std::unique_ptr<elf::Image> img, std::string dir, std::string logical_dir);

  const elf::Image& image() const { return *img_; }
  const ModuleLookup& lookup(uint64_t vaddr, DebugFinder& finder, const Options& opts);
  // Path of the separate debug file in use ("" if none); loads the module.
  std::string debug_path(DebugFinder& finder, const Options& opts);
  // Loaded without asking debuginfod (deferred) where it would have asked:
  // forget what was read, so that the next lookup loads it again.
  bool reset_if_deferred();

 private:
  void load(DebugFinder& finder, const Options& opts);

  std::unique_ptr<elf::Image> img_;
  std::unique_ptr<elf::Image> debug_;
  std::string dir_, logical_dir_;
  bool loaded_ = false;
  bool deferred_ = false;  // loaded while debuginfod was deferred, and it would have been asked
  SymbolTable symbols_;
  std::unique_ptr<DwarfIndex> dwarf_;
  std::unordered_map<uint64_t, ModuleLookup> memo_;
};

std::string demangle(const std::string& name);

}  // namespace memtrace::symbolize
