// Allocator discovery and per-process uprobe attach.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "elf/elf_file.h"
#include "loader/procfs.h"
#include "memtrace.h"
#include "probes/allocators.h"
#include "probes/probe_placement.h"

struct bpf_link;
struct bpf_program;

namespace memtrace::loader {

struct ProbeSite {
  uint32_t role = 0;
  std::string symbol;
  uint64_t file_offset = 0;  // of the symbol
  uint64_t vaddr = 0;
  probes::Placement placement;
  bool retprobe = false;
  std::string alias_of;  // another role's symbol at the same address: not attached twice
};

// An object (ELF file) that provides an allocator, or a C++ runtime whose
// aligned operator new is probed (family "c++"), or both (a static
// program); analysed once per run.
struct AllocatorObject {
  std::string path;  // as in /proc/PID/maps
  uint64_t dev = 0, inode = 0;
  std::string family;  // "glibc", "jemalloc", ..., "c++" (no allocator, only cxx)
  probes::Allocator alloc;  // symbols and placements (for --explain-probes)
  std::optional<probes::Allocator> cxx;  // aligned operator new (probes::find_cxx_aligned_new)
  std::vector<ProbeSite> sites;  // alloc's, then cxx's
  bool allocator() const { return family != "c++"; }
};

// bcc memleak's -O / -S: which object provides the allocator, and the prefix
// of its symbols. Unset: found from each process's mappings.
struct AllocatorChoice {
  std::string object;                 // path or file name of the object (-O)
  std::optional<std::string> prefix;  // symbol prefix (-S)
};

// Destroying a uprobe link waits for an RCU grace period in the kernel
// (~100 ms here, measured), so links are destroyed on background threads:
// the drain loop never blocks on a detach. A link is a BPF link fd
// (uprobe_multi: closed all at once), or a perf-event uprobe (its perf event
// fd and, with cookies, its BPF link fd: closed one at a time, never while
// an attach is in progress; see attach.cpp). detach_wait() joins the threads
// and closes the urgent ones (probes that still fire: a live process's,
// system-wide ones) before the tool exits; detach_in_background() then hands
// the perf events of exited processes still open to a process that closes
// them while the tool exits.
struct Link {
  int fd = -1;       // BPF link
  int perf_fd = -1;  // perf event (perf-event uprobes)
};
void detach_async(std::vector<Link> links, bool urgent);
// prog on the perf event pfd (a uprobe's): through a BPF link that carries
// the cookie (5.15), or PERF_EVENT_IOC_SET_BPF where there are no cookies
// (5.10). The Link, or the errno (pfd closed).
Result<Link> attach_to_perf_event(bpf_program* prog, int pfd, uint64_t cookie, bool with_cookie);
// Perf-event uprobes closed during the run: the time in their closes and
// the sets (processes, images) they were (STATS uprobe_detach_us, _sets).
struct DetachStats {
  uint64_t us = 0, sets = 0;
};
DetachStats detach_stats();
void detach_wait();
void detach_in_background();
// A process that outlives the tool and closes links for it (the guardian,
// guardian.h): given its own references to a set of link fds, it closes
// them in the background; false if it could not take them. Set, every BPF
// link fd goes there (at once: no thread here waits on a detach), the
// perf-event uprobes once no attach can follow (detach_wait), and the tool
// exits without waiting for a single detach.
using LinkSink = std::function<bool(const std::vector<int>& fds)>;
void set_link_sink(LinkSink sink);
// While one lives, no perf-event uprobe is closed (see attach.cpp).
struct AttachScope {
  AttachScope();
  ~AttachScope();
};

// Links of one attachment (one process, or system-wide for one object);
// destroying it detaches every probe.
class ProbeSet {
 public:
  ProbeSet() = default;
  ProbeSet(const ProbeSet&) = delete;
  ProbeSet& operator=(const ProbeSet&) = delete;
  ProbeSet(ProbeSet&& o) noexcept : links_(std::move(o.links_)) { o.links_.clear(); }
  ProbeSet& operator=(ProbeSet&& o) noexcept;
  ~ProbeSet() { reset(); }
  void reset();              // the process is gone: closed in the background
  void reset_before_exit();  // the probes still fire: closed before the tool exits
  void add_fd(int link_fd) { links_.push_back({link_fd, -1}); }
  void add(Link l) { links_.push_back(l); }
  void absorb(ProbeSet&& o) {  // o's links now detach with this set
    links_.insert(links_.end(), o.links_.begin(), o.links_.end());
    o.links_.clear();
  }
  size_t size() const { return links_.size(); }

 private:
  std::vector<Link> links_;
};

// How allocator probes reach the kernel, chosen from the kernel's features.
enum class AttachMode {
  UprobeMulti,  // BPF_TRACE_UPROBE_MULTI (6.6): two links per process, cookies per offset
  PerfEvent,    // one perf-event uprobe per probe (5.15: BPF cookie through a BPF link)
  PerfEventPerRole,  // no cookies (before 5.15): one perf-event uprobe per probe, one
                     // entry program per role; probes only where ret_at is 0
};

class Attacher {
 public:
  // enter: the entry program, or with PerfEventPerRole one per role (index = role).
  Attacher(std::vector<bpf_program*> enter, bpf_program* exit, AttachMode mode, AllocatorChoice choice = {})
      : enter_(std::move(enter)), exit_(exit), mode_(mode), choice_(std::move(choice)) {}

  // The allocator object a process uses, from its mappings (not a hard-coded
  // path): the executable if it defines malloc, else a non-glibc allocator
  // library (jemalloc, tcmalloc, ... preloaded), else glibc. nullptr if none.
  Result<const AllocatorObject*> find_allocator(pid_t pid, const std::vector<MapEntry>& maps,
                                                MapEntry* where);

  // The allocator an executable file mapping provides, if any (analysed once
  // per file). For a second allocator mapped after the first (dlopen), or a
  // C++ runtime (family "c++", whatever -O names).
  Result<const AllocatorObject*> object_at(pid_t pid, const MapEntry& m);

  // The C++ runtimes among a process's mappings whose aligned operator new
  // gets probes of its own (objects that are only that: a static program's
  // comes with its allocator), one entry per file, whatever -O/-S name.
  std::vector<std::pair<const AllocatorObject*, MapEntry>> cxx_runtimes(pid_t pid, const std::vector<MapEntry>& maps);

  // Attach every probe of obj for pid (-1: every process that maps it).
  // image: the process's image (mt_target.image), carried in every cookie
  // (MT_COOKIE_IMAGE_SHIFT); 0 for system-wide probes.
  Result<ProbeSet> attach(const AllocatorObject& obj, pid_t pid, const std::string& open_path, uint32_t image = 0);
  // Called before the first attach: the probe programs still being verified
  // (--inject: bpf_object.h, load_objects) are waited for; its error is the
  // attach's.
  void set_ready(std::function<Result<void>()> f) { ready_ = std::move(f); }

  // --explain-probes text for an object.
  static std::string explain(const AllocatorObject& obj);

  const std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<AllocatorObject>>& objects() const {
    return objects_;
  }
  std::vector<std::string>& notes() { return notes_; }

 private:
  Result<const AllocatorObject*> analyze(const std::string& open_path, const MapEntry& m);

  bool object_matches(const std::string& path) const;

  std::vector<bpf_program*> enter_;
  bpf_program* exit_;
  AttachMode mode_;
  AllocatorChoice choice_;
  std::function<Result<void>()> ready_;
  // (dev, inode) -> analysis; nullptr value: not an allocator.
  std::map<std::pair<uint64_t, uint64_t>, std::unique_ptr<AllocatorObject>> objects_;
  std::vector<std::string> notes_;  // kernel refused an offset, ...
  int shared_fallbacks_ = 0;         // shared perf-event uprobes refused: the PMU's per process
};

const char* role_name(uint32_t role);
// Before load: with AttachMode::UprobeMulti the allocator programs attach as
// uprobe_multi links (one link per process for every entry probe, one for
// every return probe), which the kernel must know at load time.
void prepare_programs(bpf_program* enter, bpf_program* exit, AttachMode mode);

}  // namespace memtrace::loader
