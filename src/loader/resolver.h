// Glue between the loader's processes and src/symbolize: captures each
// traced process's mappings while it lives and turns stack addresses into
// report frames.
#pragma once
#include <sys/types.h>

#include <map>
#include <memory>

#include "report/report.h"
#include "symbolize/symbolize.h"

namespace memtrace::loader {

class Resolver {
 public:
  explicit Resolver(symbolize::Options opts) : sym_(std::move(opts)) {}
  // Capture (or extend) pid's mappings now, while it lives.
  void capture(pid_t pid);
  // Share the parent's address space view with a child (fork).
  void inherit(pid_t parent, pid_t child);
  std::vector<report::FrameOut> resolve(pid_t pid, uint64_t addr, bool return_address);
  report::Resolver fn() {
    return [this](pid_t p, uint64_t a, bool r) { return resolve(p, a, r); };
  }

 private:
  symbolize::Symbolizer sym_;
  std::map<pid_t, std::shared_ptr<symbolize::AddressSpace>> spaces_;
};

}  // namespace memtrace::loader
