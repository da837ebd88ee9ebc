#include "process_maps.h"

#include <elf.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace memtrace::singlestep {

void ProcessSymbols::refresh() {
  loaded_ = true;
  char buf[PATH_MAX];
  std::string link = "/proc/" + std::to_string(pid_) + "/exe";
  ssize_t n = readlink(link.c_str(), buf, sizeof buf - 1);
  exe_ = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  auto maps = read_maps(pid_);
  if (!maps) return;
  std::map<std::string, Object> by_path;
  for (const auto& m : *maps) {
    if (m.path.empty() || m.path[0] != '/') continue;
    auto& o = by_path[m.path];
    if (o.path.empty()) {
      o.path = m.path;
      o.lo = m.start;
      o.hi = m.end;
      if (m.offset != 0) continue;  // bias from the offset-0 mapping
    }
    o.lo = std::min(o.lo, m.start);
    o.hi = std::max(o.hi, m.end);
    if (m.offset == 0) o.bias = m.start;  // corrected below with the first PT_LOAD vaddr
  }
  std::vector<Object> fresh;
  for (auto& [path, o] : by_path) {
    // Keep already-parsed ELF files.
    for (auto& old : objects_)
      if (old.path == path) o.elf = old.elf;
    if (!o.elf) {
      auto e = elf::ElfFile::open(path);
      if (!e) continue;
      o.elf = std::make_shared<elf::ElfFile>(std::move(*e));
    }
    if (o.elf->type() == ET_EXEC) {
      o.bias = 0;
    } else {
      uint64_t first = UINT64_MAX;
      for (const auto& s : o.elf->segments()) first = std::min<uint64_t>(first, s.vaddr & ~0xfffull);
      if (first != UINT64_MAX) o.bias -= first;
    }
    for (const auto& s : o.elf->symbols())
      if (s.type == STT_FUNC || s.type == STT_GNU_IFUNC) o.funcs.push_back(&s);
    std::sort(o.funcs.begin(), o.funcs.end(), [](auto* a, auto* b) { return a->vaddr < b->vaddr; });
    fresh.push_back(std::move(o));
  }
  objects_ = std::move(fresh);
  // Main executable first.
  std::stable_partition(objects_.begin(), objects_.end(), [&](const Object& o) { return o.path == exe_; });
}

ProcessSymbols::Object* ProcessSymbols::object_at(uint64_t addr) {
  for (auto& o : objects_)
    if (addr >= o.lo && addr < o.hi) return &o;
  return nullptr;
}

Result<SymbolRange> ProcessSymbols::find_object(const std::string& name) {
  refresh();
  for (auto& o : objects_)
    if (auto s = o.elf->find_object(name)) return SymbolRange{s->vaddr + o.bias, s->size, o.path};
  return Error::msg("symbol " + name + " not found in process " + std::to_string(pid_) +
                    " (no global variable of that name in its executable or libraries)");
}

Result<SymbolRange> ProcessSymbols::find_function(const std::string& name) {
  if (!loaded_) refresh();
  for (auto& o : objects_)
    if (auto s = o.elf->find_function(name)) return SymbolRange{s->vaddr + o.bias, s->size, o.path};
  return Error::msg("function " + name + " not found in process " + std::to_string(pid_));
}

std::string ProcessSymbols::function_of(uint64_t ip) {
  if (auto it = cache_.find(ip); it != cache_.end()) return it->second;
  if (!loaded_) refresh();
  Object* o = object_at(ip);
  if (!o) {
    refresh();
    o = object_at(ip);
  }
  std::string name;
  if (o) {
    uint64_t v = ip - o->bias;
    auto it = std::upper_bound(o->funcs.begin(), o->funcs.end(), v, [](uint64_t x, auto* s) { return x < s->vaddr; });
    if (it != o->funcs.begin()) {
      const elf::Symbol* s = *(it - 1);
      if (v < s->vaddr + std::max<uint64_t>(s->size, 1)) name = s->name;
    }
  }
  cache_[ip] = name;
  return name;
}

}  // namespace memtrace::singlestep
