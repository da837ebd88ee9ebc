#include "metrics/snapshot.h"
#include "procfs/cgroup.h"

#include <map>
#include <utility>

namespace memtrace::metrics {

std::string valid_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  for (size_t i = 0; i < n;) {
    unsigned c = p[i];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (size_t k = 1; ok && k < len; k++) {
      ok = (p[i + k] & 0xC0) == 0x80;
      cp = cp << 6 | (p[i + k] & 0x3F);
    }
    // Shortest form only, no surrogates, nothing past U+10FFFF.
    if (ok && len > 1)
      ok = cp >= (len == 2 ? 0x80u : len == 3 ? 0x800u : 0x10000u) && (cp < 0xD800 || cp > 0xDFFF) && cp <= 0x10FFFF;
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i++;
    }
  }
  return out;
}

Snapshot snapshot_of(const heap::HeapModel& m, report::Drops drops, const SnapshotOptions& o) {
  Snapshot snap;
  snap.drops = std::move(drops);
  snap.faults = o.faults;
  snap.taken = std::chrono::steady_clock::now();
  std::map<std::pair<pid_t, std::string>, size_t> at;  // series key -> index in snap.processes
  const auto& current = m.processes();
  // images(): by pid, each pid's images in exec order, the current one last.
  for (const heap::Process* p : m.images()) {
    if (p->prelude) continue;  // the tool's own code in a launched child before its exec
    auto cur = current.find(p->pid);
    bool is_current = cur != current.end() && cur->second.get() == p;
    if (!heap::active(*p) && !(o.include_idle && is_current)) continue;
    std::string comm = valid_utf8(p->comm);
    auto [it, fresh] = at.try_emplace({p->pid, comm}, snap.processes.size());
    if (fresh) snap.processes.emplace_back();
    ProcessSample& s = snap.processes[it->second];
    s.pid = p->pid;
    s.comm = std::move(comm);
    s.cgroup = valid_utf8(p->cgroup);
    s.container_id = procfs::container_of(p->cgroup).id;
    s.gone = !is_current || p->exited;
    s.in_use_bytes = p->s.in_use_bytes;
    s.in_use_blocks = p->s.in_use_blocks;
    s.peak_bytes = p->s.peak_in_use_bytes;
    s.mapped_allocator = p->s.mapped_now_allocator;
    s.mapped_program = p->s.mapped_now_direct;
    s.allocs += p->s.allocs;
    s.frees += p->s.frees;
    s.bytes_allocated += p->s.bytes_allocated;
    s.failed_allocs += p->s.failed_allocs;
    s.mmap_allocator += p->s.mmap_bytes_allocator;
    s.mmap_program += p->s.mmap_bytes_direct;
    s.in_use_python = p->s.python.in_use_bytes;
    s.in_use_malloc = p->s.in_use_bytes - p->s.python.in_use_bytes;
    s.allocs_python += p->s.python.allocs;
    s.allocs_malloc += p->s.allocs - p->s.python.allocs;
    s.faults += p->f.total;
    s.pages_touched += p->f.pages_first_touched;
  }
  return snap;
}

}  // namespace memtrace::metrics
