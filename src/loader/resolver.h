// Glue between the loader's processes and src/symbolize: captures each
// traced process's mappings while it lives and turns stack addresses into
// report frames.
#pragma once
#include <sys/types.h>

#include <map>
#include <memory>
#include <set>

#include "report/report.h"
#include "symbolize/symbolize.h"

namespace memtrace::loader {

using AddressSpaces = std::map<pid_t, std::shared_ptr<symbolize::AddressSpace>>;

// Frames for addr in pid's address space; a forked child's address not in
// its own mappings (or a child never captured) is looked up in its parent's
// (parents: child -> parent). missing: the reason when no space is known.
std::vector<report::FrameOut> resolve_frames(symbolize::Symbolizer& sym, const AddressSpaces& spaces,
                                             const std::map<pid_t, pid_t>& parents, pid_t pid, uint64_t addr,
                                             bool return_address, const char* missing);

class Resolver {
 public:
  explicit Resolver(symbolize::Options opts) : sym_(std::move(opts)) {}
  // Capture (or extend) pid's mappings now, while it lives.
  void capture(pid_t pid);
  // Share the parent's address space view with a child (fork).
  void inherit(pid_t parent, pid_t child);
  // pid exec'd: capture its new image's mappings now.
  void exec(pid_t pid);
  std::vector<report::FrameOut> resolve(pid_t pid, uint64_t addr, bool return_address);
  // The final report: debuginfod may be asked from now on (symbolize.h).
  void allow_debuginfod() { sym_.allow_debuginfod(); }
  report::Resolver fn() {
    return [this](pid_t p, uint64_t a, bool r) { return resolve(p, a, r); };
  }

 private:
  symbolize::Symbolizer sym_;
  AddressSpaces spaces_;
  std::map<pid_t, pid_t> parent_;
  std::set<pid_t> never_captured_;
  std::set<pid_t> incomplete_;

 public:
  // Processes that exited before their mappings could be read (system-wide
  // mode does not stop new processes): their frames stay unsymbolized.
  size_t never_captured() const { return never_captured_.size(); }
  // Processes gone before a later read (a library mapped after the first
  // read): frames in that library stay unsymbolized.
  size_t incomplete() const { return incomplete_.size(); }
};

}  // namespace memtrace::loader
