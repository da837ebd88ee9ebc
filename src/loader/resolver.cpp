#include "loader/resolver.h"

namespace memtrace::loader {

void Resolver::capture(pid_t pid) {
  auto& as = spaces_[pid];
  if (!as) as = std::make_shared<symbolize::AddressSpace>();
  (void)sym_.update(*as, pid);  // a process that is already gone keeps what we had
}

void Resolver::inherit(pid_t parent, pid_t child) {
  // The child starts with the parent's mappings; capture() adds its own.
  auto it = spaces_.find(parent);
  capture(child);
  if (it == spaces_.end()) return;
}

std::vector<report::FrameOut> Resolver::resolve(pid_t pid, uint64_t addr, bool return_address) {
  std::vector<report::FrameOut> out;
  auto it = spaces_.find(pid);
  if (it == spaces_.end()) {
    report::FrameOut f;
    f.address = addr;
    f.unknown = "process mappings never captured";
    out.push_back(f);
    return out;
  }
  const symbolize::Symbolized& s = sym_.symbolize(*it->second, addr, return_address);
  if (s.unknown != symbolize::Unknown::None || s.frames.empty()) {
    report::FrameOut f;
    f.address = addr;
    f.module = s.module;
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
    f.file = fr.file;
    f.line = fr.line;
    f.inlined = fr.inlined;
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace memtrace::loader
