#include "loader/resolver.h"

#include <elf.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>

#include "elf/elf_file.h"

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

std::vector<report::FrameOut> location_frames(symbolize::Symbolizer& sym, const heap::Loc& loc, uint64_t addr,
                                              bool return_address) {
  return frames_of(sym.symbolize_at(loc.module, loc.offset, return_address), addr);
}

SpaceNode& Resolver::current(pid_t pid) {
  auto& v = images_[pid];
  if (v.empty()) v.push_back(Image{0, std::make_shared<SpaceNode>()});
  return *v.back().node;
}

void Resolver::capture(pid_t pid, const std::vector<procfs::Mapping>* maps) {
  note_paths(maps);
  SpaceNode& n = current(pid);
  // A process that is already gone keeps what we had; one gone before its
  // first capture has nothing: counted (its frames print "unknown").
  bool ok = static_cast<bool>(sym_.update(n.as, pid, maps));
  if (ok) never_captured_.erase(pid);
  else if (n.as.mapping_count() == 0 && !n.parent) never_captured_.insert(pid);
  else if (n.as.mapping_count() > 0) incomplete_.insert(pid);  // code mapped since the last read: not seen
  after_read(pid, images_[pid].back(), ok);
}

void Resolver::exec(pid_t pid, uint64_t exec_id, const std::vector<procfs::Mapping>* maps) {
  note_paths(maps);
  auto& v = images_[pid];
  if (v.empty() || v.back().exec_id != exec_id) v.push_back(Image{exec_id, std::make_shared<SpaceNode>()});
  // Its own code now: gone before this read, its frames have no mappings of
  // their own (the parent's, if forked, are another program's).
  bool ok = static_cast<bool>(sym_.update(v.back().node->as, pid, maps));
  if (ok) never_captured_.erase(pid);
  else never_captured_.insert(pid);
  after_read(pid, v.back(), ok);
}

void Resolver::note_paths(const std::vector<procfs::Mapping>* maps) {
  if (!maps) return;
  for (const auto& m : *maps)
    if (m.exec() && m.file() && !m.path.ends_with(" (deleted)")) paths_.try_emplace({m.dev, m.inode}, m.path);
}

void Resolver::after_read(pid_t pid, Image& im, bool ok) {
  im.gone = !ok;
  std::vector<KernelMapping> pending = std::move(im.pending);
  im.pending.clear();
  if (ok) return;  // the read has them
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
      v.push_back(Image{k.exec_id, std::make_shared<SpaceNode>()});
      im = &v.back();
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
  if (exec_id && (v.empty() || v.back().exec_id != exec_id))
    v.push_back(Image{exec_id, std::make_shared<SpaceNode>()});
  current(pid);
  if (v.back().node->as.mapping_count() == 0) never_captured_.insert(pid);
  else incomplete_.insert(pid);
  after_read(pid, v.back(), false);
}

void Resolver::exited(pid_t pid) {
  auto it = images_.find(pid);
  if (it == images_.end() || it->second.empty()) return;
  Image& im = it->second.back();
  im.gone = true;
  std::vector<KernelMapping> pending = std::move(im.pending);
  im.pending.clear();
  for (const auto& k : pending) give(pid, im, k);
}

void Resolver::give(pid_t pid, Image& im, const KernelMapping& k) {
  std::vector<procfs::Mapping> maps = mappings_of(k);
  if (maps.empty()) {
    kernel_unresolved_++;
    return;
  }
  // Not where the space has code already (a read that came after the
  // mapping while the loader was behind: the same mapping).
  auto have = sym_.location_ranges(im.node->as);
  std::erase_if(maps, [&](const procfs::Mapping& m) {
    return std::any_of(have.begin(), have.end(), [&](const auto& r) { return r.start < m.end && m.start < r.end; });
  });
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

}  // namespace

std::vector<procfs::Mapping> Resolver::mappings_of(const KernelMapping& k) {
  std::string path;
  if (auto it = paths_.find({k.dev, k.inode}); it != paths_.end()) path = it->second;
  if (!k.exe) {
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
  if (path.empty()) return {};
  auto out = code_of(path, k.start, 0);
  if (out.empty() || !k.base) return out;
  // Its dynamic loader, at the auxiliary vector's AT_BASE.
  if (auto f = elf::ElfFile::open(path); f && !f->image().interp().empty()) {
    std::string ld = checked_path(f->image().interp(), 0, 0);
    if (!ld.empty())
      for (auto& m : code_of(ld, 0, k.base)) out.push_back(std::move(m));
  }
  return out;
}

void Resolver::inherit(pid_t parent, pid_t child, const std::vector<procfs::Mapping>* maps) {
  note_paths(maps);
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
  capture(child, maps);
}

void Resolver::forked(pid_t parent, pid_t child) {
  auto node = std::make_shared<SpaceNode>();
  if (auto it = images_.find(parent); it != images_.end() && !it->second.empty())
    node->parent = it->second.back().node;
  images_[child] = {Image{0, std::move(node)}};
}

void Resolver::forget(pid_t pid) { images_.erase(pid); }

const SpaceNode* Resolver::node_of(const heap::Process& p) const {
  auto it = images_.find(p.pid);
  if (it == images_.end() || it->second.empty()) return nullptr;
  const Image* best = &it->second.front();
  for (const Image& im : it->second)  // exec ids are times: increasing
    if (im.exec_id <= p.exec_ts) best = &im;
  return best->node.get();
}

heap::ImageMap Resolver::map_of(const heap::Process& p) { return image_map(sym_, node_of(p)); }

heap::ImageMap image_map(symbolize::Symbolizer& sym, const SpaceNode* node) {
  heap::ImageMap m;
  m.unknown = sym.unmapped_module();
  int hops = 0;
  for (const SpaceNode* n = node; n && hops < 16; n = n->parent.get(), hops++) {
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
  return m;
}

std::vector<report::FrameOut> Resolver::resolve(const heap::Process& p, uint64_t addr, const heap::Loc* loc,
                                                bool return_address) {
  if (loc) return location_frames(sym_, *loc, addr, return_address);
  return resolve_frames(sym_, node_of(p), addr, return_address, "process mappings never captured");
}

}  // namespace memtrace::loader
