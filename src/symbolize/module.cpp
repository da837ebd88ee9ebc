#include "symbolize/module.h"

#include <cxxabi.h>

#include <cstdlib>

#include "symbolize/minidebuginfo.h"

namespace memtrace::symbolize {

std::string demangle(const std::string& name) {
  // Bounded: the demangler recurses, and a hostile name could be long.
  if (name.size() < 3 || name[0] != '_' || name[1] != 'Z' || name.size() > 16384) return name;
  int status = 0;
  char* d = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  std::string out = (status == 0 && d) ? std::string(d) : name;
  std::free(d);
  return out;
}

Module::Module(std::unique_ptr<elf::Image> img, std::string dir, std::string logical_dir)
    : img_(std::move(img)), dir_(std::move(dir)), logical_dir_(std::move(logical_dir)) {}

void Module::load(DebugFinder& finder, const Options& opts) {
  if (loaded_) return;
  loaded_ = true;
  bool want_dwarf = opts.dwarf && !img_->has_dwarf();
  if (want_dwarf || !img_->has_symtab()) {
    debug_ = finder.find(*img_, dir_, logical_dir_);
    deferred_ = !debug_ && finder.would_ask_debuginfod(*img_);
  }
  symbols_.add_functions(*img_, true, true);
  if (debug_) symbols_.add_functions(*debug_, true, false);
  // MiniDebugInfo: the static functions' symbols of a stripped binary, when
  // no debug file brought a .symtab. A bad section only loses those names.
  if (!img_->has_symtab() && !(debug_ && debug_->has_symtab()))
    if (auto mini = open_minidebuginfo(*img_); mini && *mini) symbols_.add_functions(**mini, true, false);
  symbols_.finish();
  if (opts.dwarf) {
    if (img_->has_dwarf()) dwarf_ = DwarfIndex::create(*img_);
    if (!dwarf_ && debug_) dwarf_ = DwarfIndex::create(*debug_);
  }
}

bool Module::reset_if_deferred() {
  if (!deferred_) return false;
  deferred_ = loaded_ = false;
  debug_.reset();
  symbols_ = SymbolTable{};
  dwarf_.reset();
  memo_.clear();
  return true;
}

std::string Module::debug_path(DebugFinder& finder, const Options& opts) {
  load(finder, opts);
  return debug_ ? debug_->path() : std::string();
}

const ModuleLookup& Module::lookup(uint64_t vaddr, DebugFinder& finder, const Options& opts) {
  if (auto it = memo_.find(vaddr); it != memo_.end()) return it->second;
  load(finder, opts);
  ModuleLookup res;
  const SymbolEntry* sym = symbols_.find(vaddr);
  // A symbol names only the bytes its st_size covers: past them (a stripped
  // binary's static functions, after a .dynsym export) the address is unknown,
  // not "export+0x6228" (addr2line -f says ?? too). A size-less symbol
  // (hand-written assembly) reaches no further than its code section (_init
  // must not swallow .plt).
  if (sym && vaddr - sym->addr >= sym->size &&
      (sym->size > 0 || vaddr >= img_->exec_end(sym->addr)))
    sym = nullptr;
  std::vector<DwarfFrame> df;
  auto dm = [&](const std::string& n) { return opts.demangle ? demangle(n) : n; };
  if (dwarf_ && dwarf_->lookup(vaddr, df) && !df.empty()) {
    for (size_t i = 0; i < df.size(); ++i) {
      Frame f;
      f.function = dm(df[i].name);
      f.file = std::move(df[i].file);
      f.line = df[i].line;
      f.column = df[i].column;
      f.inlined = df[i].inlined;
      bool outermost = i + 1 == df.size();
      // An out-of-line function known to DWARF by its plain name only (static
      // functions, clones): the ELF symbol starting there names it fully,
      // "ns::helper(int)", "f(int) [clone .constprop.0]" (as binutils
      // addr2line does once it has seen the function's entry).
      if (!f.inlined && !df[i].linkage && sym && sym->addr == df[i].entry)
        f.function = dm(symbols_.name(*sym));
      if (outermost && f.function.empty() && sym) f.function = dm(symbols_.name(*sym));
      if (outermost && sym) f.offset = vaddr - sym->addr;
      else if (df[i].entry && vaddr >= df[i].entry) f.offset = vaddr - df[i].entry;
      res.frames.push_back(std::move(f));
    }
    const Frame& outer = res.frames.back();
    if (outer.function.empty() && outer.file.empty()) {
      res.frames.clear();
      res.unknown = Unknown::NoSymbols;
    }
  } else if (sym) {
    Frame f;
    f.function = dm(symbols_.name(*sym));
    f.offset = vaddr - sym->addr;
    res.frames.push_back(std::move(f));
  } else {
    res.unknown = Unknown::NoSymbols;
  }
  return memo_.emplace(vaddr, std::move(res)).first->second;
}

}  // namespace memtrace::symbolize
