// Tracer: the python domain (issue 32). A CPython process python_add found
// gets uprobes on pymalloc's functions (src/python/pymem.h finds them) and,
// where PGO inlined them behind a compare, its allocator slots pointed at a
// jmp to the same function so the calls reach the probe; the slots get
// their values back when tracing ends.
#include <iostream>

#include "loader/tracer.h"

namespace memtrace::loader {

void Tracer::pymem_add(pid_t pid, const python::Interpreter& in, const std::vector<procfs::Mapping>& maps) {
  if (!o_.python_domain || !attacher_ || finishing_ || pymem_.count(pid)) return;
  std::string why;
  auto pm = python::find_pymalloc(pid, in, maps, &why);
  if (!pm) {
    log("pid " + std::to_string(pid) + ": " + why);
    if (pymem_said_.insert(why.substr(0, why.find(" of pid"))).second && why.find("PYTHONMALLOC") == std::string::npos)
      std::cerr << "memtrace-bpf: " << why << "\n";
    return;
  }
  const procfs::Mapping* where = nullptr;
  for (const auto& m : maps)
    if (m.exec() && m.path == in.path) where = &m;
  if (!where) return;
  AllocatorObject obj;
  obj.path = in.path;
  obj.dev = where->dev;
  obj.inode = where->inode;
  obj.family = "pymalloc";
  for (const auto& s : pm->sites) {
    ProbeSite site;
    site.role = s.role;
    site.symbol = s.name;
    site.file_offset = s.file_offset;
    site.vaddr = s.vaddr;
    site.placement = s.placement;
    site.retprobe = probes::has_return_probe(static_cast<probes::Role>(s.role));
    obj.sites.push_back(std::move(site));
  }
  if (o_.explain_probes)
    for (const auto& s : pm->sites)
      std::cerr << "  " << s.name << ": " << probes::describe(s.placement) << "\n";
  auto set = attacher_->attach(obj, pid, openable_path(pid, *where), image_of(pid));
  if (!set) {
    pymem_failed_++;
    errors_.push_back("python domain of pid " + std::to_string(pid) + ": " + set.error().message);
    return;
  }
  PyMemProc& p = pymem_[pid];
  p.probes = std::move(*set);
  // After the probes: no call through a slot passes unseen.
  std::string err;
  if (!python::write_slots(pid, pm->slots, false, &err)) {
    pymem_failed_++;
    errors_.push_back("python domain of pid " + std::to_string(pid) + ": " + err);
    python::write_slots(pid, pm->slots, true, nullptr);
  } else {
    p.slots = pm->slots;
  }
  pymem_procs_++;
  pymem_inlined_ += pm->inlined_sites;
  log("pid " + std::to_string(pid) + ": " + pm->note + "; " + std::to_string(p.slots.size()) + " allocator slots moved");
}

void Tracer::pymem_forget(pid_t pid, bool exited) {
  auto it = pymem_.find(pid);
  if (it == pymem_.end()) return;
  if (!exited) python::write_slots(pid, it->second.slots, true, nullptr);  // an exec'd image has none
  it->second.probes.reset();
  pymem_.erase(it);
}

void Tracer::pymem_restore_all() {
  for (auto& [pid, p] : pymem_) {
    std::string err;
    if (!p.slots.empty() && process_exists(pid) && !python::write_slots(pid, p.slots, true, &err))
      errors_.push_back("python domain: restore the allocator of pid " + std::to_string(pid) + ": " + err);
    p.slots.clear();
  }
}

void Tracer::pymem_drops(report::Drops& d) const {
  if (!pymem_procs_ && !pymem_failed_) return;
  d.stats["python_domain_processes"] = pymem_procs_;
  // Copies of pymalloc's functions PGO inlined where no slot could send
  // the calls to a probe: their calls are not seen (docs/python.md).
  d.stats["python_domain_inlined_sites_unseen"] = pymem_inlined_;
  d.dropped["python_domain_attach_failed"] = pymem_failed_;
}

}  // namespace memtrace::loader
