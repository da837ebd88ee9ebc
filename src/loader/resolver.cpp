#include "loader/resolver.h"

#include <algorithm>

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
  SpaceNode& n = current(pid);
  // A process that is already gone keeps what we had; one gone before its
  // first capture has nothing: counted (its frames print "unknown").
  if (sym_.update(n.as, pid, maps)) never_captured_.erase(pid);
  else if (n.as.mapping_count() == 0 && !n.parent) never_captured_.insert(pid);
  else if (n.as.mapping_count() > 0) incomplete_.insert(pid);  // code mapped since the last read: not seen
}

void Resolver::exec(pid_t pid, uint64_t exec_id, const std::vector<procfs::Mapping>* maps) {
  auto& v = images_[pid];
  if (v.empty() || v.back().exec_id != exec_id) v.push_back(Image{exec_id, std::make_shared<SpaceNode>()});
  // Its own code now: gone before this read, its frames have no mappings of
  // their own (the parent's, if forked, are another program's).
  if (sym_.update(v.back().node->as, pid, maps)) never_captured_.erase(pid);
  else never_captured_.insert(pid);
}

void Resolver::inherit(pid_t parent, pid_t child, const std::vector<procfs::Mapping>* maps) {
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
