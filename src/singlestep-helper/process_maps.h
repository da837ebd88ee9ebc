// /proc/PID/maps and ELF symbols of a running process: page protections (what
// to restore), the load bias of each object (for --symbol NAME and to name ips).
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "procfs/proc_maps.h"
#include "elf/elf_file.h"

namespace memtrace::singlestep {

using Mapping = procfs::Mapping;  // src/procfs: the one parser of /proc/PID/maps
using procfs::read_maps;

struct SymbolRange {
  uint64_t start = 0, size = 0;
  std::string object;
};

class ProcessSymbols {
 public:
  explicit ProcessSymbols(pid_t pid) : pid_(pid) {}
  // Global variable by name: the main executable first, then every mapped object.
  Result<SymbolRange> find_object(const std::string& name);
  Result<SymbolRange> find_function(const std::string& name);
  // "function" or "" for an ip; re-reads the maps once for an unknown address.
  std::string function_of(uint64_t ip);

 private:
  struct Object {
    std::string path;
    uint64_t bias = 0, lo = 0, hi = 0;
    std::shared_ptr<elf::ElfFile> elf;
    std::vector<const elf::Symbol*> funcs;  // sorted by vaddr
  };
  void refresh();
  Object* object_at(uint64_t addr);
  pid_t pid_;
  bool loaded_ = false;
  std::vector<Object> objects_;
  std::string exe_;
  std::map<uint64_t, std::string> cache_;
};

}  // namespace memtrace::singlestep
