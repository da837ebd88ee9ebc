#include "loader/resolver.h"

namespace memtrace::loader {

void Resolver::capture(pid_t pid) {
  auto& as = spaces_[pid];
  if (!as) as = std::make_shared<symbolize::AddressSpace>();
  // A process that is already gone keeps what we had; one gone before its
  // first capture has nothing: counted (its frames print "unknown").
  if (sym_.update(*as, pid)) never_captured_.erase(pid);
  else if (as->mapping_count() == 0 && !parent_.count(pid)) never_captured_.insert(pid);
  else if (as->mapping_count() > 0) incomplete_.insert(pid);  // code mapped since the last read: not seen
}

void Resolver::exec(pid_t pid) {
  auto& as = spaces_[pid];
  if (!as) as = std::make_shared<symbolize::AddressSpace>();
  // Its own code now: gone before this read, its frames have no mappings of
  // their own (the parent's, if forked, are another program's).
  if (sym_.update(*as, pid)) never_captured_.erase(pid);
  else never_captured_.insert(pid);
}

void Resolver::inherit(pid_t parent, pid_t child) {
  // The child starts with the parent's mappings (captured now, while it is
  // stopped at its first return). If it is already gone, or later exec's or
  // unmaps, addresses of blocks it inherited are looked up in the parent's.
  // A child gone before this read is not counted as never captured: its
  // addresses are its parent's (a later exec of it captures anew, and counts
  // if that fails: exec() below).
  parent_[child] = parent;
  capture(child);
}


std::vector<report::FrameOut> resolve_frames(symbolize::Symbolizer& sym, const AddressSpaces& spaces,
                                             const std::map<pid_t, pid_t>& parents, pid_t pid, uint64_t addr,
                                             bool return_address, const char* missing) {
  std::vector<report::FrameOut> out;
  const symbolize::Symbolized* sp = nullptr;
  for (pid_t p = pid, hops = 0; hops < 16; hops++) {
    auto it = spaces.find(p);
    if (it != spaces.end()) {
      sp = &sym.symbolize(*it->second, addr, return_address);
      if (sp->unknown != symbolize::Unknown::Unmapped) break;
    }
    auto pp = parents.find(p);
    if (pp == parents.end()) break;
    p = pp->second;
  }
  if (!sp) {
    report::FrameOut f;
    f.address = addr;
    f.unknown = missing;
    out.push_back(f);
    return out;
  }
  const symbolize::Symbolized& s = *sp;
  if (s.unknown != symbolize::Unknown::None || s.frames.empty()) {
    report::FrameOut f;
    f.address = addr;
    f.module = s.module;
    f.module_offset = s.module_offset;
    f.unknown = symbolize::to_string(s.unknown);
    out.push_back(f);
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

std::vector<report::FrameOut> Resolver::resolve(pid_t pid, uint64_t addr, bool return_address) {
  return resolve_frames(sym_, spaces_, parent_, pid, addr, return_address, "process mappings never captured");
}

}  // namespace memtrace::loader
