#include "symbolize/symbolize.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>

#include "common/fd.h"
#include "symbolize/call_site.h"
#include "symbolize/debug_finder.h"
#include "symbolize/module.h"
#include "procfs/proc_maps.h"

namespace memtrace::symbolize {

const char* to_string(Unknown u) {
  switch (u) {
    case Unknown::None: return "none";
    case Unknown::Unmapped: return "unmapped";
    case Unknown::NoSymbols: return "no symbols";
    case Unknown::FileGone: return "file gone";
    case Unknown::BadFile: return "bad file";
    case Unknown::Anonymous: return "anonymous memory";
  }
  return "unknown";
}

std::string to_string(const Frame& f) {
  std::string s = f.inlined ? "[inlined] " : "";
  s += f.function.empty() ? "??" : f.function;
  if (!f.inlined && f.offset) {
    char b[32];
    std::snprintf(b, sizeof b, "+0x%" PRIx64, f.offset);
    s += b;
  }
  s += " (";
  s += f.file.empty() ? "??" : f.file;
  s += ":" + std::to_string(f.line);
  if (f.column) s += ":" + std::to_string(f.column);
  s += ")";
  return s;
}

namespace {

struct MapEntry {
  MappingInfo info;
  std::shared_ptr<Module> module;  // null when the file could not be used
  Unknown failure = Unknown::None;
  mutable uint32_t loc_module = 0;  // its module id in Symbolizer::location_ranges (0: not asked yet)
};

using MapKey = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, std::string>;

std::string dirname_of(const std::string& p) {
  auto s = p.rfind('/');
  if (s == std::string::npos) return "";
  if (s == 0) return "/";
  return p.substr(0, s);
}

constexpr std::string_view kDeleted = " (deleted)";

std::string strip_deleted(const std::string& p) {
  if (p.size() > kDeleted.size() && p.compare(p.size() - kDeleted.size(), kDeleted.size(), kDeleted) == 0)
    return p.substr(0, p.size() - kDeleted.size());
  return p;
}

}  // namespace

struct AddressSpace::Impl {
  pid_t pid = 0;
  std::vector<std::shared_ptr<const MapEntry>> all;  // never dropped
  std::set<MapKey> seen;
  // Current view: start -> (end, entry). Newer mappings shadow older ones
  // where they overlap; the older remain reachable outside the overlap.
  std::map<uint64_t, std::pair<uint64_t, const MapEntry*>> view;
  mutable std::unordered_map<uint64_t, Symbolized> memo[2];
  mutable uint64_t memo_generation = 0;  // Symbolizer::Impl::generation the memos belong to

  void insert(std::shared_ptr<const MapEntry> e) {
    uint64_t s = e->info.start, en = e->info.end;
    auto it = view.lower_bound(s);
    if (it != view.begin()) --it;
    while (it != view.end() && it->first < en) {
      uint64_t os = it->first, oe = it->second.first;
      const MapEntry* oent = it->second.second;
      if (oe <= s) {
        ++it;
        continue;
      }
      it = view.erase(it);
      if (os < s) view.emplace(os, std::make_pair(s, oent));
      if (oe > en) view.emplace(en, std::make_pair(oe, oent));
    }
    view[s] = {en, e.get()};
    all.push_back(std::move(e));
    memo[0].clear();
    memo[1].clear();
  }

  const MapEntry* find(uint64_t a) const {
    auto it = view.upper_bound(a);
    if (it == view.begin()) return nullptr;
    --it;
    return a < it->second.first ? it->second.second : nullptr;
  }
};

AddressSpace::AddressSpace() : impl_(std::make_unique<Impl>()) {}
AddressSpace::~AddressSpace() = default;
AddressSpace::AddressSpace(AddressSpace&&) noexcept = default;
AddressSpace& AddressSpace::operator=(AddressSpace&&) noexcept = default;
pid_t AddressSpace::pid() const { return impl_->pid; }
size_t AddressSpace::mapping_count() const { return impl_->all.size(); }

struct Symbolizer::Impl {
  // Location modules (see Symbolizer::locate): what one id stands for.
  struct LocModule {
    std::shared_ptr<Module> module;
    std::string path;
    Unknown failure = Unknown::None;
  };
  std::vector<LocModule> loc_modules{LocModule{}};  // [0] unused: ids start at 1
  std::map<std::tuple<const Module*, std::string, Unknown>, uint32_t> loc_ids;
  struct LocKey {
    uint64_t offset;
    uint32_t module;
    bool ra;
    bool operator==(const LocKey& o) const { return offset == o.offset && module == o.module && ra == o.ra; }
  };
  struct LocHash {
    size_t operator()(const LocKey& k) const { return k.offset * 0x9e3779b97f4a7c15ull ^ k.module << 1 ^ k.ra; }
  };
  std::unordered_map<LocKey, Symbolized, LocHash> loc_memo;
  uint64_t loc_memo_generation = 0;

  uint32_t loc_module(const std::shared_ptr<Module>& m, const std::string& path, Unknown failure) {
    auto [it, fresh] = loc_ids.try_emplace({m.get(), path, failure}, static_cast<uint32_t>(loc_modules.size()));
    if (fresh) loc_modules.push_back(LocModule{m, path, failure});
    return it->second;
  }

  Options opts;
  DebugFinder finder;
  std::map<std::pair<uint64_t, uint64_t>, std::pair<std::shared_ptr<Module>, Unknown>> by_devino;
  std::unordered_map<std::string, std::shared_ptr<Module>> by_build_id;
  Stats stats;
  uint64_t generation = 0;  // bumped when modules are read again (allow_debuginfod)

  explicit Impl(Options o) : opts(std::move(o)), finder(opts) { finder.set_deferred(opts.defer_debuginfod); }

  // Opened file -> module (cached by dev+inode, then by build-id).
  std::pair<std::shared_ptr<Module>, Unknown> open_module(Fd fd, const std::string& path,
                                                          const std::string& dir,
                                                          const std::string& logical_dir) {
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return {nullptr, Unknown::FileGone};
    auto key = std::make_pair(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
    if (auto it = by_devino.find(key); it != by_devino.end()) return it->second;
    ++stats.files_opened;
    std::pair<std::shared_ptr<Module>, Unknown> res{nullptr, Unknown::BadFile};
    auto img = elf::Image::open_fd(std::move(fd), path);
    if (img && !(*img)->segments().empty()) {
      std::string bid = (*img)->build_id();
      if (auto it = !bid.empty() ? by_build_id.find(bid) : by_build_id.end(); it != by_build_id.end()) {
        res = {it->second, Unknown::None};
      } else {
        auto m = std::make_shared<Module>(std::move(img).value(), dir, logical_dir);
        ++stats.modules;
        if (!bid.empty()) by_build_id.emplace(bid, m);
        res = {m, Unknown::None};
      }
    }
    by_devino.emplace(key, res);
    return res;
  }
};

Symbolizer::Symbolizer(Options opts) : impl_(std::make_unique<Impl>(std::move(opts))) {}
Symbolizer::~Symbolizer() = default;

Symbolizer::Stats Symbolizer::stats() const { return impl_->stats; }

void Symbolizer::allow_debuginfod() {
  impl_->finder.set_deferred(false);
  bool again = false;
  for (auto& [key, entry] : impl_->by_devino)
    if (entry.first) again |= entry.first->reset_if_deferred();
  if (again) ++impl_->generation;
}

Result<void> Symbolizer::update(AddressSpace& as, pid_t pid, const std::vector<MappingInfo>* given) {
  Result<std::vector<MappingInfo>> read = std::vector<MappingInfo>{};
  if (!given) {
    read = procfs::read_maps(pid);
    if (!read) return read.error();
  }
  const std::vector<MappingInfo>* maps = given ? given : &*read;
  auto& a = as.impl();
  a.pid = pid;
  const std::string proc = "/proc/" + std::to_string(pid);
  // A process in another mount namespace / chroot: its paths resolve under
  // /proc/PID/root. Same root as ours: plain paths (they survive its exit).
  std::string root_prefix;
  struct stat r1, r2;
  if (::stat((proc + "/root").c_str(), &r1) == 0 && ::stat("/", &r2) == 0 &&
      (r1.st_dev != r2.st_dev || r1.st_ino != r2.st_ino))
    root_prefix = proc + "/root";

  for (const auto& m : *maps) {
    if (m.perms.find('x') == std::string::npos) continue;
    MapKey key{m.start, m.end, m.offset, m.dev, m.inode, m.path};
    if (!a.seen.insert(key).second) continue;
    auto e = std::make_shared<MapEntry>();
    e->info = m;
    if (m.path.empty() || m.path[0] != '/') {
      e->failure = Unknown::Anonymous;
      a.insert(std::move(e));
      continue;
    }
    std::string logical = strip_deleted(m.path);
    char range[64];
    std::snprintf(range, sizeof range, "/map_files/%" PRIx64 "-%" PRIx64, m.start, m.end);
    // map_files: the very file mapped, even deleted or replaced (needs CAP_SYS_ADMIN).
    Fd fd;
    if (impl_->opts.use_map_files) fd.reset(::open((proc + range).c_str(), O_RDONLY | O_CLOEXEC));
    // Else by path: as is when it is the same file (same device and inode; it
    // stays reachable after the process exits), else through /proc/PID/root
    // (a container's mount namespace or chroot; same inode). Never a file that
    // replaced the mapped one: that would symbolize other code.
    std::string via;
    if (!fd.valid()) {
      Fd f2(::open(logical.c_str(), O_RDONLY | O_CLOEXEC));
      struct stat st;
      if (f2.valid() && ::fstat(f2.get(), &st) == 0 && st.st_ino == m.inode &&
          static_cast<uint64_t>(st.st_dev) == m.dev) {
        fd = std::move(f2);
        via = logical;
      }
    }
    if (!fd.valid()) {
      std::string p = proc + "/root" + logical;
      Fd f2(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
      struct stat st;
      if (f2.valid() && ::fstat(f2.get(), &st) == 0 && (m.inode == 0 || st.st_ino == m.inode)) {
        fd = std::move(f2);
        via = p;
      }
    }
    if (!fd.valid()) {
      e->failure = Unknown::FileGone;
    } else {
      std::string dir = via.empty() ? root_prefix + dirname_of(logical) : dirname_of(via);
      auto [mod, fail] = impl_->open_module(std::move(fd), logical, dir, dirname_of(logical));
      e->module = std::move(mod);
      e->failure = fail;
    }
    a.insert(std::move(e));
  }
  return {};
}

void Symbolizer::add_mapping(AddressSpace& as, const MappingInfo& m, const std::string& open_path) {
  auto& a = as.impl();
  MapKey key{m.start, m.end, m.offset, m.dev, m.inode, m.path};
  a.seen.insert(key);
  auto e = std::make_shared<MapEntry>();
  e->info = m;
  Fd fd(::open(open_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    e->failure = Unknown::FileGone;
  } else {
    std::string logical = strip_deleted(m.path.empty() ? open_path : m.path);
    auto [mod, fail] = impl_->open_module(std::move(fd), open_path, dirname_of(open_path), dirname_of(logical));
    e->module = std::move(mod);
    e->failure = fail;
  }
  a.insert(std::move(e));
}

Result<void> Symbolizer::add_file(AddressSpace& as, const std::string& path, uint64_t bias) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Error::sys("open " + path);
  auto [mod, fail] = impl_->open_module(std::move(fd), path, dirname_of(path), dirname_of(path));
  if (!mod) return Error::msg(path + ": " + to_string(fail));
  struct stat st;
  ::stat(path.c_str(), &st);
  auto& a = as.impl();
  for (const auto& seg : mod->image().segments()) {
    auto e = std::make_shared<MapEntry>();
    uint64_t head = seg.offset % 4096;
    e->info.start = bias + seg.vaddr - head;
    e->info.end = (bias + seg.vaddr + seg.memsz + 4095) & ~uint64_t{4095};
    e->info.offset = seg.offset - head;
    e->info.dev = st.st_dev;
    e->info.inode = st.st_ino;
    e->info.perms = std::string(seg.flags & 4 ? "r" : "-") + (seg.flags & 2 ? "w" : "-") +
                    (seg.flags & 1 ? "x" : "-") + "p";
    e->info.path = path;
    e->module = mod;
    if (e->info.end <= e->info.start) continue;
    a.seen.insert(MapKey{e->info.start, e->info.end, e->info.offset, e->info.dev, e->info.inode, path});
    a.insert(std::move(e));
  }
  return {};
}

// The frames of a file offset in module (mapped at path), as symbolize() gives them.
static void lookup_in(Symbolized& s, Module* module, Unknown failure, const std::string& path, uint64_t pc_offset,
                      DebugFinder& finder, const Options& opts, Symbolizer::Stats& stats) {
  s.module = path;
  s.module_offset = pc_offset;
  if (!module) {
    s.unknown = failure == Unknown::None ? Unknown::FileGone : failure;
  } else if (auto vaddr = module->image().offset_to_vaddr(pc_offset); !vaddr) {
    s.unknown = Unknown::NoSymbols;
  } else {
    ++stats.module_lookups;
    const ModuleLookup& ml = module->lookup(*vaddr, finder, opts);
    s.unknown = ml.unknown;
    s.frames = ml.frames;
    for (auto& f : s.frames) f.module = path;
  }
}

const Symbolized& Symbolizer::symbolize(const AddressSpace& as, uint64_t address, bool return_address) {
  ++impl_->stats.lookups;
  const auto& a = as.impl();
  if (a.memo_generation != impl_->generation) {
    a.memo[0].clear();
    a.memo[1].clear();
    a.memo_generation = impl_->generation;
  }
  auto& memo = a.memo[return_address ? 1 : 0];
  if (auto it = memo.find(address); it != memo.end()) return it->second;
  Symbolized s;
  s.address = address;
  uint64_t pc = return_address && address > 0 ? address - 1 : address;
  const MapEntry* e = a.find(pc);
  if (!e) s.unknown = Unknown::Unmapped;
  else lookup_in(s, e->module.get(), e->failure, e->info.path, pc - e->info.start + e->info.offset, impl_->finder,
                 impl_->opts, impl_->stats);
  return memo.emplace(address, std::move(s)).first->second;
}

std::vector<Symbolizer::LocationRange> Symbolizer::location_ranges(const AddressSpace& as) {
  std::vector<LocationRange> out;
  out.reserve(as.impl().view.size());
  for (const auto& [start, v] : as.impl().view) {
    const MapEntry* e = v.second;
    if (!e->loc_module)  // once per mapping: one id per file at its path, or per failure
      e->loc_module = impl_->loc_module(e->module, e->info.path, e->module ? Unknown::None : e->failure);
    out.push_back({start, v.first, e->loc_module, e->info.start - e->info.offset});
  }
  return out;
}

uint32_t Symbolizer::unmapped_module() { return impl_->loc_module(nullptr, "", Unknown::Unmapped); }
uint32_t Symbolizer::anonymous_module() { return impl_->loc_module(nullptr, "", Unknown::Anonymous); }
bool Symbolizer::is_anonymous_module(uint32_t module) const {
  return module && module < impl_->loc_modules.size() && impl_->loc_modules[module].failure == Unknown::Anonymous &&
         (impl_->loc_modules[module].path.empty() || impl_->loc_modules[module].path.rfind("[anon", 0) == 0);
}

const Symbolized& Symbolizer::symbolize_at(uint32_t module, uint64_t offset, bool return_address) {
  ++impl_->stats.lookups;
  if (impl_->loc_memo_generation != impl_->generation) {
    impl_->loc_memo.clear();
    impl_->loc_memo_generation = impl_->generation;
  }
  Impl::LocKey key{offset, module, return_address};
  if (auto it = impl_->loc_memo.find(key); it != impl_->loc_memo.end()) return it->second;
  Symbolized s;
  const Impl::LocModule* m = module < impl_->loc_modules.size() ? &impl_->loc_modules[module] : nullptr;
  if (!m || !module || m->failure == Unknown::Unmapped) {
    s.unknown = Unknown::Unmapped;
    s.address = offset;
  } else {
    uint64_t pc_offset = return_address && offset > 0 ? offset - 1 : offset;
    lookup_in(s, m->module.get(), m->failure, m->path, pc_offset, impl_->finder, impl_->opts, impl_->stats);
  }
  return impl_->loc_memo.emplace(key, std::move(s)).first->second;
}

namespace {

// call_site.h on the file behind a module; true when there is none.
bool module_follows_call(const Module* m, uint64_t offset) {
  if (!m) return true;
  const elf::Image& img = m->image();
  uint64_t back = std::min<uint64_t>(offset, 8);
  std::string_view before = img.bytes(offset - back, back);
  if (before.size() != back || back == 0) return true;  // past the file's end or at its start: not known
  return follows_call(before, img.bytes(offset, 12), img.machine());
}

}  // namespace

bool Symbolizer::follows_call(const AddressSpace& as, uint64_t address) {
  const MapEntry* e = address ? as.impl().find(address - 1) : nullptr;
  if (!e) return false;
  return module_follows_call(e->module.get(), address - e->info.start + e->info.offset);
}

bool Symbolizer::follows_call_at(uint32_t module, uint64_t offset) {
  const Impl::LocModule* m = module < impl_->loc_modules.size() ? &impl_->loc_modules[module] : nullptr;
  if (!m || !module || m->failure == Unknown::Unmapped) return false;
  return module_follows_call(m->module.get(), offset);
}

bool Symbolizer::has_anonymous_code(const AddressSpace& as) const {
  for (const auto& e : as.impl().all)
    if (e->failure == Unknown::Anonymous && e->info.path.empty()) return true;  // not [vdso], [uprobes]
  return false;
}

std::string Symbolizer::debug_file(const AddressSpace& as, uint64_t address) {
  const MapEntry* e = as.impl().find(address);
  if (!e || !e->module) return "";
  return e->module->debug_path(impl_->finder, impl_->opts);
}

}  // namespace memtrace::symbolize
