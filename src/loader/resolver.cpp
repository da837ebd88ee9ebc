#include "loader/resolver.h"

#include <elf.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>

#include "elf/elf_file.h"
#include "loader/procfs.h"

namespace memtrace::loader {

namespace {

std::vector<report::FrameOut> frames_of(const symbolize::Symbolized& s, uint64_t addr) {
  std::vector<report::FrameOut> out;
  if (s.unknown != symbolize::Unknown::None || s.frames.empty()) {
    report::FrameOut f;
    f.address = addr;
    f.module = s.module;
    f.module_offset = s.module_offset;
    f.unknown = symbolize::to_string(s.unknown);
    out.push_back(std::move(f));
    return out;
  }
  for (const auto& fr : s.frames) {
    report::FrameOut f;
    f.address = addr;
    f.function = fr.function;
    f.offset = fr.offset;
    f.module = fr.module;
    f.module_offset = s.module_offset;
    f.file = fr.file;
    f.line = fr.line;
    f.column = fr.column;
    f.inlined = fr.inlined;
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace

std::vector<report::FrameOut> resolve_frames(symbolize::Symbolizer& sym, const SpaceNode* node, uint64_t addr,
                                             bool return_address, const char* missing) {
  const symbolize::Symbolized* sp = nullptr;
  for (int hops = 0; node && hops < 16; node = node->parent.get(), hops++) {
    sp = &sym.symbolize(node->as, addr, return_address);
    if (sp->unknown != symbolize::Unknown::Unmapped) break;
  }
  if (!sp) {
    report::FrameOut f;
    f.address = addr;
    f.unknown = missing;
    return {f};
  }
  return frames_of(*sp, addr);
}

std::optional<report::FrameOut> jit_frame(const symbolize::PerfMap& m, uint64_t addr, bool return_address,
                                          const std::string& module) {
  uint64_t pc = return_address && addr ? addr - 1 : addr;  // a return address: the call is before it
  const symbolize::PerfMapEntry* e = m.find(pc);
  if (!e) return std::nullopt;
  report::FrameOut f;
  f.address = addr;
  f.function = e->name;
  f.offset = addr - e->start;
  f.module = module;
  f.module_offset = addr - e->start;
  return f;
}

bool jit_candidate(const std::vector<report::FrameOut>& frames) {
  return frames.size() == 1 && frames[0].function.empty() &&
         (frames[0].unknown == symbolize::to_string(symbolize::Unknown::Anonymous) ||
          frames[0].unknown == symbolize::to_string(symbolize::Unknown::Unmapped));
}

report::FrameOut python_frame(const python::FrameTable* t, uint64_t addr) {
  report::FrameOut f;
  f.address = addr;
  f.module = "python";
  const python::PyFrame* pf = t ? t->find(static_cast<uint32_t>(addr & ~heap::kPyFrameTag)) : nullptr;
  if (!pf) {
    f.unknown = "python frame not recorded";
    return f;
  }
  f.function = pf->function;
  f.file = pf->file;
  f.line = pf->line;
  return f;
}

std::vector<report::FrameOut> location_frames(symbolize::Symbolizer& sym, const heap::Loc& loc, uint64_t addr,
                                              bool return_address) {
  return frames_of(sym.symbolize_at(loc.module, loc.offset, return_address), addr);
}

Resolver::Image::Image(uint64_t id, std::shared_ptr<SpaceNode> n) : exec_id(id), node(std::move(n)) {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  since = uint64_t(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
}

namespace {

// A read of pid's maps into as. One that has none is not a read of its
// mappings either: its mm is gone (exiting, a zombie; or a kernel thread).
enum class Read { Ok, Empty, Failed };
Read read_into(symbolize::Symbolizer& sym, symbolize::AddressSpace& as, pid_t pid,
               const std::vector<procfs::Mapping>* maps) {
  Result<std::vector<procfs::Mapping>> own = std::vector<procfs::Mapping>{};
  if (!maps) {
    if (!(own = procfs::read_maps(pid))) return Read::Failed;
    maps = &*own;
  }
  if (maps->empty()) return Read::Empty;
  return sym.update(as, pid, maps) ? Read::Ok : Read::Failed;
}

}  // namespace

SpaceNode& Resolver::current(pid_t pid) {
  auto& v = images_[pid];
  if (v.empty()) v.push_back(Image{0, std::make_shared<SpaceNode>()});
  return *v.back().node;
}

void Resolver::capture(pid_t pid, const std::vector<procfs::Mapping>* maps) {
  note_paths(pid, maps);
  SpaceNode& n = current(pid);
  // A process that is already gone keeps what we had; one gone before its
  // first capture has nothing: counted (its frames print "unknown").
  Read r = read_into(sym_, n.as, pid, maps);
  if (r == Read::Ok) {
    never_captured_.erase(pid);
    note_started(pid, images_[pid].back());
  } else if (r == Read::Empty) {}  // as before: not counted (but what the kernel told is given)
  else if (n.as.mapping_count() == 0 && !n.parent) never_captured_.insert(pid);
  else if (n.as.mapping_count() > 0) incomplete_.insert(pid);  // code mapped since the last read: not seen
  after_read(pid, images_[pid].back(), r == Read::Ok);
}

void Resolver::exec(pid_t pid, uint64_t exec_id, const std::vector<procfs::Mapping>* maps) {
  note_paths(pid, maps);
  auto& v = images_[pid];
  if (v.empty() || v.back().exec_id != exec_id) {
    if (!v.empty()) ended(pid, v.back());
    v.push_back(Image{exec_id, std::make_shared<SpaceNode>()});
    if (v.size() > 1) v.back().parent = v[v.size() - 2].parent;
  }
  // Its own code now: gone before this read, its frames have no mappings of
  // their own (the parent's, if forked, are another program's).
  Read r = read_into(sym_, v.back().node->as, pid, maps);
  if (r == Read::Ok) {
    never_captured_.erase(pid);
    note_started(pid, v.back());
  } else if (r == Read::Failed) never_captured_.insert(pid);
  after_read(pid, v.back(), r == Read::Ok);
}

void Resolver::note_paths(pid_t pid, const std::vector<procfs::Mapping>* maps) {
  if (!maps) return;
  for (const auto& m : *maps) {
    std::pair<uint64_t, uint64_t> key{m.dev, m.inode};
    if (!m.exec() || !m.file() || m.path.ends_with(" (deleted)") || paths_.count(key)) continue;
    if (foreign_.count(key)) {
      if (container_pids_.size() < 256) container_pids_.insert(pid);
      continue;
    }
    // Not the file here: a file of another root (a container's libc at the
    // path of the host's own; a path of its mount namespace that names no
    // file here), never taken for it. Where a gone process of that root has
    // its files (roots_of): this process's root, the directory when the
    // path is one of that root.
    struct stat st {}, there {};
    if (stat(m.path.c_str(), &st) != 0 || static_cast<uint64_t>(st.st_dev) != m.dev || st.st_ino != m.inode) {
      foreign_.insert(key);
      if (container_pids_.size() < 256) container_pids_.insert(pid);
      std::string root = "/proc/" + std::to_string(pid) + "/root";
      if (stat((root + m.path).c_str(), &there) == 0 && static_cast<uint64_t>(there.st_dev) == m.dev &&
          there.st_ino == m.inode)
        if (auto slash = m.path.rfind('/'); slash != std::string::npos && slash > 0)
          foreign_dirs_.insert(m.path.substr(0, slash));
      continue;
    }
    paths_.emplace(key, m.path);
    if (auto slash = m.path.rfind('/'); slash != std::string::npos && slash > 0) dirs_.insert(m.path.substr(0, slash));
  }
}

void Resolver::after_read(pid_t pid, Image& im, bool ok) {
  im.gone = !ok;
  // Given even after a good read: where the read has code they are
  // skipped (give), and a read that came after the next exec has not
  // this image's libraries.
  flush(pid, im);
}

void Resolver::flush(pid_t pid, Image& im) {
  std::vector<KernelMapping> pending = std::move(im.pending);
  im.pending.clear();
  for (const auto& k : pending) give(pid, im, k);
}

void Resolver::kernel_mapped(pid_t pid, const KernelMapping& k) {
  auto& v = images_[pid];
  Image* im = nullptr;
  if (k.exe) {
    // The exec's own image (its record comes right after the exec's).
    for (auto& i : v)
      if (i.exec_id == k.exec_id) im = &i;
    if (!im) {
      if (!v.empty()) ended(pid, v.back());
      v.push_back(Image{k.exec_id, std::make_shared<SpaceNode>()});
      if (v.size() > 1) v.back().parent = v[v.size() - 2].parent;
      im = &v.back();
    }
    im->exe = k;  // kept: its libraries are looked for in its RUNPATH
    // Its directory is one where libraries are looked for: programs load
    // plugins from their own (ld, run by gcc's collect2, its -plugin from
    // the directory of cc1, collect2 and lto-wrapper), all of them maybe
    // gone unread.
    im->program.clear();
    if (const std::string& prog = program_of(*im); !prog.empty()) dirs_.insert(prog.substr(0, std::max<size_t>(prog.rfind('/'), 1)));
    // Its exec's read has no code where this program's is (mm's start_code):
    // the read came after a later exec (env running bash, a shell's exec at
    // once), that image's mappings, not this one's. This image gets what
    // the kernel tells.
    if (!im->gone && k.start && im->node->as.mapping_count() > 0) {
      auto have = sym_.location_ranges(im->node->as);
      if (std::none_of(have.begin(), have.end(), [&](const auto& r) { return r.start <= k.start && k.start < r.end; })) {
        im->node = std::make_shared<SpaceNode>();
        im->gone = true;
        misread_++;
      }
    }
  } else {
    current(pid);
    im = &v.back();
  }
  if (im->gone) give(pid, *im, k);
  else im->pending.push_back(k);
}

void Resolver::unreadable(pid_t pid, uint64_t exec_id) {
  auto& v = images_[pid];
  if (exec_id && (v.empty() || v.back().exec_id != exec_id)) {
    if (!v.empty()) ended(pid, v.back());
    v.push_back(Image{exec_id, std::make_shared<SpaceNode>()});
    if (v.size() > 1) v.back().parent = v[v.size() - 2].parent;
  }
  current(pid);
  if (v.back().node->as.mapping_count() == 0) never_captured_.insert(pid);
  else incomplete_.insert(pid);
  after_read(pid, v.back(), false);
}

void Resolver::exited(pid_t pid) {
  auto it = images_.find(pid);
  if (it == images_.end() || it->second.empty()) return;
  ended(pid, it->second.back());
}

// im will not be read again (its process exited or exec'd): what the
// kernel told since its last read goes to its space.
void Resolver::ended(pid_t pid, Image& im) {
  im.gone = true;
  flush(pid, im);
}

void Resolver::give(pid_t pid, Image& im, const KernelMapping& k) {
  // Not where the space has code already (a read that came after the
  // mapping: the same mapping); nor looked for then (the program's
  // start_code read: its ld.so was mapped with it).
  auto have = sym_.location_ranges(im.node->as);
  auto covered = [&](uint64_t lo, uint64_t hi) {
    return std::any_of(have.begin(), have.end(), [&](const auto& r) { return r.start < hi && lo < r.end; });
  };
  if (k.start && covered(k.start, k.exe ? k.start + 1 : k.end)) return;
  std::vector<procfs::Mapping> maps = mappings_of(k, im);
  if (maps.empty()) {
    if (im.gone) kernel_unresolved_++;  // (a read image's: what its read did not cover, uncounted)
    return;
  }
  std::erase_if(maps, [&](const procfs::Mapping& m) { return covered(m.start, m.end); });
  if (maps.empty()) return;
  for (const auto& m : maps) sym_.add_mapping(im.node->as, m, m.path);
  kernel_given_ += maps.size();
  if (on_given_) on_given_(pid, maps);
}

namespace {

// An executable's path that is (dev, inode), or "".
std::string checked_path(const std::string& path, uint64_t dev, uint64_t inode) {
  if (path.empty() || path[0] != '/') return "";
  char real[PATH_MAX];
  if (!realpath(path.c_str(), real)) return "";
  struct stat st {};
  if (stat(real, &st) != 0 || !S_ISREG(st.st_mode)) return "";
  if (dev && (static_cast<uint64_t>(st.st_dev) != dev || st.st_ino != inode)) return "";
  return real;
}

// The executable PT_LOADs of the ELF file at path, loaded so that the first
// of them is at `first` (mm's start_code) or, first == 0, at bias `bias`.
std::vector<procfs::Mapping> code_of(const std::string& path, uint64_t first, uint64_t bias) {
  std::vector<procfs::Mapping> out;
  auto f = elf::ElfFile::open(path);
  if (!f) return out;
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return out;
  const elf::Segment* lo = nullptr;
  for (const auto& s : f->segments())
    if ((s.flags & PF_X) && (!lo || s.vaddr < lo->vaddr)) lo = &s;
  if (!lo) return out;
  if (first) bias = first - lo->vaddr;
  for (const auto& s : f->segments()) {
    if (!(s.flags & PF_X)) continue;
    procfs::Mapping m;
    m.start = (bias + s.vaddr) & ~uint64_t{4095};
    m.end = (bias + s.vaddr + s.memsz + 4095) & ~uint64_t{4095};
    m.offset = s.offset & ~uint64_t{4095};
    m.dev = st.st_dev;
    m.inode = st.st_ino;
    m.perms = "r-xp";
    m.path = path;
    out.push_back(std::move(m));
  }
  return out;
}

// A directory list as RUNPATH has it, $ORIGIN (the program's directory)
// expanded; entries with other tokens ($LIB, $PLATFORM) are left out.
std::vector<std::string> runpath_dirs(const std::string& list, const std::string& origin) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= list.size()) {
    size_t end = list.find(':', at);
    if (end == std::string::npos) end = list.size();
    std::string d = list.substr(at, end - at);
    at = end + 1;
    for (const char* tok : {"${ORIGIN}", "$ORIGIN"})
      for (size_t p; (p = d.find(tok)) != std::string::npos;) d.replace(p, strlen(tok), origin);
    if (d.empty() || d[0] != '/' || d.find('$') != std::string::npos) continue;
    while (d.size() > 1 && d.back() == '/') d.pop_back();
    out.push_back(std::move(d));
  }
  return out;
}

// The directories of the files /etc/ld.so.cache lists (its strings that are
// absolute paths), then ld.so's default directories; root: another root's
// cache (a container's; the directories as named there).
std::vector<std::string> system_library_dirs(const std::string& root = "") {
  std::vector<std::string> out;
  std::set<std::string> seen;
  auto add = [&](std::string d) {
    if (seen.insert(d).second) out.push_back(std::move(d));
  };
  std::ifstream f(root + "/etc/ld.so.cache", std::ios::binary);
  std::string cache((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (cache.find("glibc-ld.so.cache") != std::string::npos) {
    for (size_t at = 0; at < cache.size();) {
      size_t end = cache.find('\0', at);
      if (end == std::string::npos) break;
      if (cache[at] == '/' && end - at < PATH_MAX) {
        std::string_view path(cache.data() + at, end - at);
        if (size_t slash = path.rfind('/'); slash > 0) add(std::string(path.substr(0, slash)));
      }
      at = end + 1;
    }
  }
#if defined(__x86_64__)
  const char* multiarch = "x86_64-linux-gnu";
#elif defined(__aarch64__)
  const char* multiarch = "aarch64-linux-gnu";
#else
  const char* multiarch = nullptr;
#endif
  if (multiarch) {
    add(std::string("/lib/") + multiarch);
    add(std::string("/usr/lib/") + multiarch);
  }
  for (const char* d : {"/lib64", "/usr/lib64", "/lib", "/usr/lib", "/usr/local/lib"}) add(d);
  return out;
}

// k under a (longer) name.
KernelMapping named_as(const KernelMapping& k, const std::string& name) {
  KernelMapping n = k;
  n.path = name;
  n.name_cut = false;
  return n;
}

// dir/name if that is the file (dev, inode); a cut name: an entry of dir
// that starts with it.
std::string in_dir(const std::string& dir, const KernelMapping& k) {
  auto is_it = [&](const std::string& p) {
    struct stat st {};
    return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_dev) == k.dev &&
           st.st_ino == k.inode;
  };
  std::string p = dir + "/" + k.path;
  if (is_it(p)) return p;
  if (!k.name_cut) return "";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.size() > k.path.size() && name.starts_with(k.path) && is_it(dir + "/" + name)) return dir + "/" + name;
  }
  return "";
}

// The root a path through /proc/PID/root/ is in ("" for another path).
std::string root_in(const std::string& path) {
  if (!path.starts_with("/proc/")) return "";
  size_t at = path.find("/root/");
  return at == std::string::npos ? "" : path.substr(0, at + 5);
}

}  // namespace

bool Resolver::still_there(const std::string& path, uint64_t dev, uint64_t inode) const {
  if (!path.starts_with("/proc/")) return true;  // a path of the tool's root: the file while the run lasts
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == dev && st.st_ino == inode;
}

std::vector<std::string> Resolver::roots_of(const Image& im) {
  using Key = std::tuple<uint64_t, uint64_t, uint64_t>;  // mount namespace, root (dev, inode)
  auto key_of = [](const std::string& proc) -> std::optional<Key> {
    struct stat ns {}, r {};
    if (stat((proc + "/ns/mnt").c_str(), &ns) != 0 || stat((proc + "/root/").c_str(), &r) != 0) return std::nullopt;
    return Key{ns.st_ino, r.st_dev, r.st_ino};
  };
  std::set<Key> seen;
  if (auto self = key_of("/proc/self")) seen.insert(*self);
  std::vector<std::string> out;
  auto add = [&](pid_t p) {  // false: p is gone
    std::string proc = "/proc/" + std::to_string(p);
    auto k = key_of(proc);
    if (!k) return false;
    if (seen.insert(*k).second) out.push_back(proc + "/root");
    return true;
  };
  if (im.parent > 0) add(im.parent);
  for (auto it = container_pids_.begin(); it != container_pids_.end() && out.size() < 16;)
    it = add(*it) ? std::next(it) : container_pids_.erase(it);
  return out;
}

std::string Resolver::in_roots(const std::string& path, uint64_t dev, uint64_t inode, const Image& im,
                               std::string* root) {
  if (path.empty() || path[0] != '/' || !dev) return "";
  for (const auto& r : roots_of(im)) {
    struct stat st {};
    std::string p = r + path;
    if (stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_dev) == dev &&
        st.st_ino == inode) {
      if (root) *root = r;
      return p;
    }
  }
  return "";
}

const std::string& Resolver::program_of(Image& im) {
  if (im.program.empty() && im.exe.exe) {
    if (auto it = paths_.find({im.exe.dev, im.exe.inode}); it != paths_.end()) {
      if (still_there(it->second, im.exe.dev, im.exe.inode)) im.program = it->second;
      else paths_.erase(it);
    }
    if (im.program.empty()) im.program = checked_path(im.exe.path, im.exe.dev, im.exe.inode);
    // A container's program (its path is one of its root): through a live
    // process of that root.
    if (im.program.empty()) im.program = in_roots(im.exe.path, im.exe.dev, im.exe.inode, im, nullptr);
    if (im.program.empty()) im.exe.exe = false;  // not found: not looked for again
  }
  return im.program;
}

std::string Resolver::find_library(const KernelMapping& k, Image& im) {
  if (k.path.empty() || k.path.find('/') != std::string::npos || k.path == "." || k.path == "..") return "";
  std::vector<const std::string*> dirs;
  // Nearly ld.so's order: the program's RUNPATH, the LD_LIBRARY_PATHs of
  // processes read, ld.so.cache, the default directories; then where other
  // processes' files and programs are, and the paths their arguments named.
  // Any order would do: a candidate must be the file.
  const std::string& prog = program_of(im);
  auto miss = not_found_.find({k.dev, k.inode, prog});
  if (miss != not_found_.end() && miss->second == searched()) return "";
  if (!prog.empty()) {
    auto it = runpaths_.find(prog);
    if (it == runpaths_.end()) {
      std::vector<std::string> rp;
      if (auto f = elf::ElfFile::open(prog))
        rp = runpath_dirs(f->image().search_path(), prog.substr(0, std::max<size_t>(prog.rfind('/'), 1)));
      it = runpaths_.emplace(prog, std::move(rp)).first;
    }
    for (const auto& d : it->second) dirs.push_back(&d);
  }
  for (const auto& d : env_dirs_) dirs.push_back(&d);
  if (system_dirs_.empty()) system_dirs_ = system_library_dirs();
  for (const auto& d : system_dirs_) dirs.push_back(&d);
  for (const auto& d : dirs_) dirs.push_back(&d);
  std::set<std::string_view> tried;
  for (const std::string* d : dirs) {
    if (!tried.insert(*d).second) continue;
    if (std::string p = in_dir(*d, k); !p.empty()) return p;
  }
  // Loaded by its path (dlopen of a path, ld's -plugin): where a started
  // process's arguments named a file of that name (a cut name: its start).
  for (auto it = named_.lower_bound(k.path); it != named_.end() && it->first.starts_with(k.path); ++it) {
    if (it->first != k.path && !k.name_cut) break;
    for (const auto& p : it->second)
      if (std::string f = in_dir(p.substr(0, p.rfind('/')), named_as(k, it->first)); !f.empty()) return f;
  }
  // A container's process (another mount namespace, a chroot): the same
  // directories, and those of the files its processes mapped, in the root
  // of a live process of it (its parent's first), and its own ld.so.cache's.
  std::vector<std::string> roots = roots_of(im);
  for (const auto& r : roots) {
    auto sd = root_system_dirs_.find(r);
    if (sd == root_system_dirs_.end()) {
      if (root_system_dirs_.size() > 64) root_system_dirs_.clear();
      sd = root_system_dirs_.emplace(r, system_library_dirs(r)).first;
    }
    std::set<std::string_view> in_root;
    auto try_dir = [&](const std::string& d) {
      return in_root.insert(d).second ? in_dir(r + d, k) : std::string();
    };
    for (const std::string* d : dirs)
      if (std::string p = try_dir(*d); !p.empty()) return p;
    for (const auto& d : sd->second)
      if (std::string p = try_dir(d); !p.empty()) return p;
    for (const auto& d : foreign_dirs_)
      if (std::string p = try_dir(d); !p.empty()) return p;
    for (auto it = named_.lower_bound(k.path); it != named_.end() && it->first.starts_with(k.path); ++it) {
      if (it->first != k.path && !k.name_cut) break;
      for (const auto& p : it->second)
        if (std::string f = in_dir(r + p.substr(0, p.rfind('/')), named_as(k, it->first)); !f.empty()) return f;
    }
  }
  // Its parent (a shell, make, collect2: waiting for it, alive still)
  // read now: a parent read before its own exec, or never, has told
  // nothing of what it started this process with. Once per process: a
  // pid used again is another (its start time).
  if (im.parent > 0)
    if (auto start = start_time(im.parent);
        start && parents_read_.insert({im.parent, *start}).second && note_strings(im.parent, ""))
      return find_library(k, im);
  not_found_[{k.dev, k.inode, prog}] = searched();
  return "";
}

void Resolver::note_started(pid_t pid, Image& im) {
  if (im.started_read) return;
  im.started_read = true;
  note_strings(pid, program_of(im));
}

bool Resolver::note_strings(pid_t pid, const std::string& prog) {
  size_t before = searched();
  for (const auto& e : proc_strings(pid, "environ"))
    if (e.starts_with("LD_LIBRARY_PATH=")) {
      // $ORIGIN: the program's directory (not known yet: those are left out)
      std::string origin = prog.empty() ? "$ORIGIN" : prog.substr(0, std::max<size_t>(prog.rfind('/'), 1));
      for (auto& d : runpath_dirs(e.substr(strlen("LD_LIBRARY_PATH=")), origin)) env_dirs_.insert(std::move(d));
    }
  // Absolute paths of shared objects among the arguments' words
  // ("-plugin /x/liblto_plugin.so", "-fplugin=/x/p.so", a shell's -c text).
  for (const auto& a : proc_strings(pid, "cmdline"))
    for (size_t at = a.find('/'); at != std::string::npos; at = a.find('/', at)) {
      if (at > 0 && !strchr(" \t=,:;'\"", a[at - 1])) {
        at = a.find_first_of(" \t=,:;'\"", at);
        continue;
      }
      size_t end = std::min(a.find_first_of(" \t,:;'\"", at), a.size());
      std::string path = a.substr(at, end - at);
      at = end;
      std::string name = path.substr(path.rfind('/') + 1);
      if (name.find(".so") != std::string::npos && path.size() < PATH_MAX && named_[name].insert(path).second)
        named_files_++;
    }
  return searched() != before;
}

std::vector<procfs::Mapping> Resolver::mappings_of(const KernelMapping& k, Image& im) {
  std::string path;
  if (auto it = paths_.find({k.dev, k.inode}); it != paths_.end()) {
    if (still_there(it->second, k.dev, k.inode)) path = it->second;
    else paths_.erase(it);  // through the root of a process gone since: looked for again
  }
  if (!k.exe) {
    if (path.empty() && !(path = find_library(k, im)).empty()) {
      paths_.try_emplace({k.dev, k.inode}, path);  // found: the next record of it is a lookup
      if (root_in(path).empty()) dirs_.insert(path.substr(0, path.rfind('/')));  // (a root's: with its process)
    }
    if (path.empty()) return {};
    procfs::Mapping m;
    m.start = k.start;
    m.end = k.end;
    m.offset = k.offset;
    m.dev = k.dev;
    m.inode = k.inode;
    m.perms = "r-xp";
    m.path = path;
    return {m};
  }
  if (path.empty()) path = checked_path(k.path, k.dev, k.inode);
  std::string root = root_in(path);
  if (path.empty()) path = in_roots(k.path, k.dev, k.inode, im, &root);  // a container's program
  if (path.empty()) return {};
  auto out = code_of(path, k.start, 0);
  if (out.empty() || !k.base) return out;
  // Its dynamic loader, at the auxiliary vector's AT_BASE (a container's:
  // in its root).
  if (auto f = elf::ElfFile::open(path); f && !f->image().interp().empty()) {
    std::string ld = root.empty() ? checked_path(f->image().interp(), 0, 0) : root + f->image().interp();
    if (struct stat st {}; !root.empty() && (stat(ld.c_str(), &st) != 0 || !S_ISREG(st.st_mode))) ld.clear();
    if (!ld.empty())
      for (auto& m : code_of(ld, 0, k.base)) out.push_back(std::move(m));
  }
  return out;
}

void Resolver::inherit(pid_t parent, pid_t child, const std::vector<procfs::Mapping>* maps) {
  note_paths(child, maps);
  // The child starts with the parent's mappings (captured now, while it is
  // stopped at its first return). If it is already gone, or later exec's or
  // unmaps, addresses of blocks it inherited are looked up in the parent's.
  // A child gone before this read is not counted as never captured: its
  // addresses are its parent's (a later exec of it captures anew, and counts
  // if that fails: exec() above).
  auto node = std::make_shared<SpaceNode>();
  if (auto it = images_.find(parent); it != images_.end() && !it->second.empty())
    node->parent = it->second.back().node;
  images_[child] = {Image{0, std::move(node)}};  // a reused pid starts afresh
  images_[child].back().parent = parent;
  capture(child, maps);
}

void Resolver::forked(pid_t parent, pid_t child, uint64_t fork_ts) {
  if (parent == child) return;  // not a fork (a corrupt record)
  // The parent's image at the fork: its last exec before it (a later one's
  // exec record may have been read first).
  const Image* from = nullptr;
  if (auto it = images_.find(parent); it != images_.end())
    for (const Image& im : it->second)
      if (im.exec_id <= fork_ts) from = &im;
  // The child's images made since the fork are its own (its exec read
  // already, or code it mapped); older ones are a gone process's (a reused pid).
  auto& v = images_[child];
  std::erase_if(v, [&](const Image& im) { return im.exec_id ? im.exec_id < fork_ts : im.since < fork_ts; });
  if (v.empty() || v.front().exec_id) v.insert(v.begin(), Image{0, std::make_shared<SpaceNode>()});
  Image& first = v.front();
  for (Image& im : v) im.parent = parent;
  // The child may end (exec) before the parent's image is read: what the
  // kernel told of the parent's mappings goes to its space now.
  if (from) flush(parent, const_cast<Image&>(*from));
  if (from) {
    first.node->parent = from->node;
    if (!first.exe.exe) {
      first.exe = from->exe;  // its libraries are looked for where the parent's are
      first.program = from->program;
    }
  }
}

// Its image is sealed: nothing of pid is asked again but a JIT frame's name
// (a process with a perf map keeps it). Its counts stay counted.
void Resolver::forget(pid_t pid) {
  images_.erase(pid);
  if (auto it = jit_.find(pid); it != jit_.end() && !it->second.file.found()) jit_.erase(it);
  never_captured_gone_ += never_captured_.erase(pid);
  incomplete_gone_ += incomplete_.erase(pid);
}

const Resolver::Image* Resolver::image_of(const heap::Process& p) const {
  auto it = images_.find(p.pid);
  if (it == images_.end() || it->second.empty()) return nullptr;
  const Image* best = &it->second.front();
  for (const Image& im : it->second)  // exec ids are times: increasing
    if (im.exec_id <= p.exec_ts) best = &im;
  return best;
}

const SpaceNode* Resolver::node_of(const heap::Process& p) const {
  const Image* im = image_of(p);
  return im ? im->node.get() : nullptr;
}

heap::ImageMap Resolver::map_of(const heap::Process& p) {
  // p's image ended (it is being sealed): what the kernel told since its
  // last read is all there will be.
  if (const Image* im = image_of(p)) ended(p.pid, const_cast<Image&>(*im));
  heap::ImageMap m = image_map(sym_, node_of(p));
  // JIT code made after the last read of its mappings: its perf map says so.
  if (const symbolize::PerfMap* pm = perf_map(p.pid, true); pm && pm->size()) mark_jit(sym_, m);
  return m;
}

heap::ImageMap image_map(symbolize::Symbolizer& sym, const SpaceNode* node) {
  heap::ImageMap m;
  m.unknown = sym.unmapped_module();
  m.follows_call = [&sym](const heap::Loc& l) { return sym.follows_call_at(l.module, l.offset); };
  int hops = 0;
  for (const SpaceNode* n = node; n && hops < 16; n = n->parent.get(), hops++) {
    m.jit |= sym.has_anonymous_code(n->as);
    // An ancestor's ranges only where the nearer spaces have none.
    std::vector<heap::ImageRange> add;
    for (const auto& r : sym.location_ranges(n->as)) {
      uint64_t lo = r.start;
      auto it = std::upper_bound(m.ranges.begin(), m.ranges.end(), lo,
                                 [](uint64_t a, const heap::ImageRange& x) { return a < x.start; });
      if (it != m.ranges.begin() && std::prev(it)->end > lo) lo = std::prev(it)->end;
      for (; lo < r.end; ++it) {
        uint64_t hi = it == m.ranges.end() ? r.end : std::min(r.end, it->start);
        if (lo < hi) add.push_back({lo, hi, r.module, r.bias});
        if (it == m.ranges.end()) break;
        lo = std::max(lo, it->end);
      }
    }
    m.ranges.insert(m.ranges.end(), add.begin(), add.end());
    std::sort(m.ranges.begin(), m.ranges.end(),
              [](const heap::ImageRange& a, const heap::ImageRange& b) { return a.start < b.start; });
  }
  if (m.jit) mark_jit(sym, m);
  return m;
}

void mark_jit(symbolize::Symbolizer& sym, heap::ImageMap& m) {
  // A JIT's code keeps its addresses (its perf map names them): in its
  // anonymous mappings and in none (code made since the last read).
  m.jit = true;
  for (auto& r : m.ranges)
    if (sym.is_anonymous_module(r.module)) r.bias = 0;
  m.jit_module = sym.anonymous_module();
}

const symbolize::PerfMap* Resolver::perf_map(pid_t pid, bool refresh) {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = uint64_t(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
  Jit& j = jit_[pid];
  if (j.last_ns && (!refresh || now - j.last_ns < 20000000ull)) return j.file.found() ? &j.file.map() : nullptr;
  j.last_ns = now;
  if (!j.file.found()) {
    // Alive: through its root, by the pid its own namespace gave it (a
    // container's /tmp); gone: the host's /tmp.
    if (process_exists(pid)) {
      pid_t ns = ns_pid_of(pid).value_or(pid);
      j.file.also("/proc/" + std::to_string(pid) + "/root/tmp/perf-" + std::to_string(ns) + ".map");
      j.file.refresh();
    }
    if (!j.file.found()) j.file.also("/tmp/perf-" + std::to_string(pid) + ".map");
  }
  j.file.refresh();
  return j.file.found() ? &j.file.map() : nullptr;
}

std::vector<std::pair<pid_t, std::string>> Resolver::perf_map_texts() {
  std::vector<std::pair<pid_t, std::string>> out;
  for (const auto& [pid, v] : images_) perf_map(pid, true);
  for (const auto& [pid, j] : jit_)
    if (j.file.found() && !j.file.text().empty()) out.emplace_back(pid, j.file.text());
  return out;
}

std::vector<report::FrameOut> Resolver::resolve(const heap::Process& p, uint64_t addr, const heap::Loc* loc,
                                                bool return_address) {
  if (addr & heap::kPyFrameTag) return {python_frame(py_, addr)};
  auto named = [&](uint64_t at) -> std::optional<report::FrameOut> {
    const symbolize::PerfMap* m = perf_map(p.pid, false);
    auto f = m ? jit_frame(*m, at, return_address, "/tmp/perf-" + std::to_string(p.pid) + ".map") : std::nullopt;
    if (!f && (m = perf_map(p.pid, true))) f = jit_frame(*m, at, return_address, "/tmp/perf-" + std::to_string(p.pid) + ".map");
    return f;
  };
  if (loc) {  // sealing cut what was untrusted
    if (sym_.is_anonymous_module(loc->module))
      if (auto f = named(loc->offset)) return {*f};
    return location_frames(sym_, *loc, addr, return_address);
  }
  const SpaceNode* node = node_of(p);
  auto out = resolve_frames(sym_, node, addr, return_address, "process mappings never captured");
  if (jit_candidate(out))
    if (auto f = named(addr)) return {*f};
  if (return_address && !out.empty() && !follows_call(sym_, node, addr)) out.front().untrusted = true;
  return out;
}

bool follows_call(symbolize::Symbolizer& sym, const SpaceNode* node, uint64_t addr) {
  bool known = false;  // some space has mappings: an address in none of them is no frame
  bool jit = false;    // unless one has a JIT's code (made since the read, maybe)
  for (int hops = 0; node && hops < 16; node = node->parent.get(), hops++) {
    if (sym.symbolize(node->as, addr, true).unknown != symbolize::Unknown::Unmapped)
      return sym.follows_call(node->as, addr);
    known |= node->as.mapping_count() > 0;
    jit |= sym.has_anonymous_code(node->as);
  }
  return !known || jit;
}

}  // namespace memtrace::loader
