// /proc/PID/maps, parsed: the one reader every part of the tool uses (the
// loader's attach and resolver, the unwinder's tables, the symbolizer, the
// single-step helper).
//
//   auto maps = procfs::read_maps(pid);        // Result<std::vector<Mapping>>
//   for (auto& m : *maps) if (m.exec() && m.file()) ...
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"

namespace memtrace::procfs {

struct Mapping {
  uint64_t start = 0, end = 0, offset = 0;  // runtime range, file offset
  uint64_t dev = 0, inode = 0;              // makedev(major, minor), inode
  std::string perms;                        // "r-xp"
  std::string path;                         // as in /proc/PID/maps ("" anonymous, "[heap]", "... (deleted)")

  bool readable() const { return perms.size() > 0 && perms[0] == 'r'; }
  bool writable() const { return perms.size() > 1 && perms[1] == 'w'; }
  bool exec() const { return perms.size() > 2 && perms[2] == 'x'; }
  bool shared() const { return perms.size() > 3 && perms[3] == 's'; }
  int prot() const;  // PROT_READ | PROT_WRITE | PROT_EXEC
  // Backed by a file this process may open (not anonymous, not [vdso]).
  bool file() const { return inode != 0 && !path.empty() && path[0] == '/'; }
};

// One line; false if it is malformed.
bool parse_maps_line(std::string_view line, Mapping& out);
std::vector<Mapping> parse_maps(std::string_view text);
// The whole file, read in one go (a consistent snapshot as far as the
// kernel gives one: it is generated in page-sized reads).
Result<std::vector<Mapping>> read_maps(pid_t pid);

// A path this process can open m's file by: PATH itself when it is the same
// inode here (it stays valid after pid is gone; a chroot's process, whose
// maps name host paths), else /proc/PID/root/PATH when that is (another
// mount namespace: a container's), else /proc/PID/map_files/START-END
// (deleted or replaced files).
std::string openable_path(pid_t pid, const Mapping& m);

}  // namespace memtrace::procfs
