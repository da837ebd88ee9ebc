// Tracer: attaching to processes (allocator uprobes per process, -c and
// system-wide discovery) and the --inject path beside it.
#include "loader/tracer.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "elf/elf_file.h"
#include "loader/output_file.h"
#include "loader/recording.h"
#include "memtrace_bpf.skel.h"
#include "memtrace_bpf_compat.skel.h"
#include "inject/injector.h"
#include "inject/session.h"
#include "procfs/cgroup.h"
#include "metrics/exporter.h"

namespace memtrace::loader {

// What every output names a process by: its comm (unless the caller knows
// it) and its cgroup (the container it runs in), read while it lives.
void Tracer::identify(pid_t pid, bool comm) {
  heap::Process& p = model_.process(pid);
  if (comm)
    if (auto c = read_comm(pid)) p.comm = *c;
  if (p.cgroup.empty())
    if (auto cg = procfs::cgroup_of(pid)) p.cgroup = *cg;
}

// Find pid's allocator and attach its probes. required: a failure is an
// error for the user (-p); otherwise it is counted (a process started later).
Result<void> Tracer::attach_process(pid_t pid, bool required, Snapshot* given) {
  inject::release_late_threads();  // a thread an earlier restore's stop found in D state, stopped since
  Snapshot own(pid, &maps_reads_);
  Snapshot& snap = given ? *given : own;
  Proc& p = procs_[pid];
  p.pid = pid;
  identify(pid);
  const auto* maps = snap.maps();
  resolver_.capture(pid, maps);
  if (p.attached || finishing_) return {};
  if (!maps) return snap.error();
  MapEntry where;
  auto obj = attacher_->find_allocator(pid, *maps, &where);
  if (!obj) return obj.error();
  if (!*obj) {
    if (required)
      return Error::msg("process " + std::to_string(pid) + " (" + model_.process(pid).comm +
                        ") has no known allocator: no object in /proc/" + std::to_string(pid) +
                        "/maps defines malloc and free");
    return {};  // not yet: a later executable mapping may bring it
  }
  // Allocator entries an earlier, killed --inject session left patched
  // (its stubs run the probed instructions past the uprobes): put back
  // before the uprobes go on (docs/inject.md). Once per process: an attach
  // that fails after it is tried again at the next mapping, its line and
  // count are not repeated.
  if (!p.leftovers_tried) {
    p.leftovers_tried = true;
    if (auto r = inject::restore_left_patched(pid, *maps); !r) {
      std::cerr << "memtrace-bpf: " << r.error().message
                << ": its allocator calls through the agent's hooks pass the uprobes: its counts will be incomplete\n";
      inject_leftovers_unrestored_++;
    } else if (*r) {
      std::cerr << "memtrace-bpf: pid " << pid << ": restored " << *r
                << " allocator entries left patched by an earlier --inject session\n";
      inject_leftovers_restored_++;
    }
  }
  if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
  auto t0 = std::chrono::steady_clock::now();
  auto set = attacher_->attach(**obj, pid, openable_path(pid, where), image_of(pid));
  if (!set) return set.error();
  uint64_t us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  attach_us_ += us;
  attach_count_++;
  p.probes = std::move(*set);
  p.attached = true;
  // A C++ runtime whose aligned operator new rounds the size up before
  // aligned_alloc (libstdc++): entry probes there for the size the program
  // asked for. Mapped later (dlopen): attach_more_allocators.
  for (const auto& [cxx, m] : attacher_->cxx_runtimes(pid, *maps)) {
    if (o_.explain_probes) std::cerr << Attacher::explain(*cxx);
    auto more = attacher_->attach(*cxx, pid, openable_path(pid, m), image_of(pid));
    if (!more) {
      errors_.push_back(more.error().message);
      attach_failures_++;
      continue;
    }
    p.probes.absorb(std::move(*more));
  }
  // The files already mapped are settled: a later mapping of a new file may
  // bring a second allocator (attach_more_allocators).
  for (const auto& m : *maps)
    if (m.exec() && m.file()) p.objects.insert({m.dev, m.inode});
  unwind_add(snap);
  set_target_state(pid, MT_TS_TRACED, 1);
  log("attached " + std::to_string(p.probes.size()) + " probes to pid " + std::to_string(pid) + " in " + where.path +
      " (" + std::to_string(us) + " us)");
  return {};
}

// A traced process mapped new code (it is stopped): a library that is an
// allocator of another family than the one attached (mimalloc dlopen'd by a
// glibc program) gets its own probes too. glibc arriving after a preloaded
// allocator does not: the program's calls go to the preloaded one.
void Tracer::attach_more_allocators(Snapshot& snap) {
  pid_t pid = snap.pid();
  Proc& p = procs_[pid];
  const auto* maps = snap.maps();
  if (!maps) return;
  for (const auto& m : *maps) {
    if (!m.exec() || !m.file()) continue;
    auto key = std::make_pair(static_cast<uint64_t>(m.dev), m.inode);
    if (!p.objects.insert(key).second) continue;
    auto obj = attacher_->object_at(pid, m);
    if (!obj || !*obj || (*obj)->family == "glibc") continue;
    if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
    auto set = attacher_->attach(**obj, pid, openable_path(pid, m), image_of(pid));
    if (!set) {
      errors_.push_back(set.error().message);
      attach_failures_++;
      continue;
    }
    log("attached " + std::to_string(set->size()) + " more probes to pid " + std::to_string(pid) + " in " +
        m.path);
    p.probes.absorb(std::move(*set));
  }
}

// System-wide: a record of pid's at `ts` (an exec, a new executable
// mapping) asks for its mappings; a read begun after ts has them already
// (ld.so maps a program's libraries in a burst: one read for the burst).
void Tracer::read_process_once(pid_t pid, uint64_t ts, uint64_t exec_id) {
  auto it = last_read_ns_.find(pid);
  if (it != last_read_ns_.end() && it->second > ts) return;
  last_read_ns_[pid] = monotonic_ns();  // features.h: bpf_ktime_get_ns's clock
  scan_system_allocators(pid, exec_id);
}

// System-wide: an attach through a file of pid's that failed because pid
// went meanwhile (its file reached through /proc/PID: a container's) is
// not the file's fault: the next process that maps it tries again.
bool Tracer::attach_again_later(pid_t pid, const std::string& why) {
  if (process_exists(pid)) return false;
  log("pid " + std::to_string(pid) + " went during its attach (" + why + "); the next process mapping the file tries again");
  return true;
}

void Tracer::set_static_known(uint64_t dev, uint64_t inode) {
  if (!skel_) return;
  mt_file_key k{(static_cast<uint64_t>(major(dev)) << 20) | minor(dev), inode};  // the kernel's s_dev
  uint32_t one = 1;
  bpf_map_update_elem(bpf_map__fd(skel_->maps.static_known), &k, &one, BPF_ANY);
}

// System-wide: pid exec'd a program that has no interpreter (statically
// linked): its allocator, if any, is in its own file, which no library
// mapping brings. At the file's first exec BPF stopped it before its first
// instruction, and read_process_once has just attached the file's probes
// (system-wide, as a new libc's: scan_system_allocators), so it is traced
// from its first call. From now on the file is known to BPF
// (static_known): its next execs are not stopped, the probes are in every
// process that maps it. A stripped one in which no allocator is found is
// counted at each exec (static_without_symbols) and named once.
void Tracer::static_exec(pid_t pid, uint32_t kdev, uint64_t inode) {
  std::string exe = "/proc/" + std::to_string(pid) + "/exe";
  auto key = std::make_pair(static_cast<uint64_t>(makedev(kdev >> 20, kdev & 0xfffff)), inode);  // as maps has it
  auto it = static_files_.find(key);
  if (it == static_files_.end()) {
    // Not looked at yet: its first exec, stopped (or not: BPF's map full,
    // the loader ending); gone already, nothing to look at.
    struct stat st {};
    if (stat(exe.c_str(), &st) != 0 || st.st_dev != key.first || st.st_ino != key.second) return;
    bool blind = false;
    if (!system_probes_.count(key) && key != self_exe_) {
      // No allocator found in it: one without a symbol table cannot be
      // looked into (ld.so run as a program is not one: it maps the program).
      char path[PATH_MAX];
      ssize_t n = readlink(exe.c_str(), path, sizeof path - 1);
      std::string name = n > 0 ? std::string(path, n) : exe;
      auto elf = elf::ElfFile::open(exe);
      blind = elf && !elf->has_symtab() && elf->image().interp().empty() &&
              name.find("/ld-linux") == std::string::npos && name.find("/ld-musl") == std::string::npos;
      if (blind)
        std::cerr << "memtrace-bpf: " << name << " (pid " << pid
                  << ") is statically linked and stripped: no allocator symbols to probe, its processes' "
                     "allocations are not traced (counted as static_without_symbols)\n";
    }
    it = static_files_.emplace(key, blind).first;
    set_static_known(key.first, key.second);
  }
  if (it->second) static_without_symbols_++;
}

void Tracer::scan_system_allocators(pid_t only, uint64_t exec_id) {
  if (self_exe_.second == 0) {
    struct stat st {};
    if (stat("/proc/self/exe", &st) == 0) self_exe_ = {static_cast<uint64_t>(st.st_dev), st.st_ino};
  }
  std::vector<pid_t> pids = only > 0 ? std::vector<pid_t>{only} : all_pids();
  for (pid_t pid : pids) {
    if (pid == getpid()) continue;
    Snapshot snap(pid, &maps_reads_);
    // Tests: a process of this name is taken for gone before its maps are
    // read (what a short process system-wide often is).
    if (!o_.test_unreadable_comm.empty() && read_comm(pid).value_or("") == o_.test_unreadable_comm) {
      resolver_.unreadable(pid, exec_id);
      continue;
    }
    const auto* maps = snap.maps();
    if (!maps) {
      // Gone before this read (an exec or a new library of a short process):
      // the resolver counts it (mappings_not_captured / _incomplete).
      if (only > 0) exec_id ? resolver_.exec(pid, exec_id) : resolver_.capture(pid);
      continue;
    }
    identify(pid, only <= 0);
    // Mappings for symbolization, while it lives (the read above: one per event).
    if (exec_id) resolver_.exec(pid, exec_id, maps);
    else resolver_.capture(pid, maps);
    unwind_add(snap);
    // C++ runtimes (libstdc++'s aligned operator new), once per file.
    for (const auto& [cxx, m] : attacher_->cxx_runtimes(pid, *maps)) {
      auto ckey = std::make_pair(cxx->dev, cxx->inode);
      if (system_probes_.count(ckey)) continue;
      if (o_.explain_probes) std::cerr << Attacher::explain(*cxx);
      auto set = attacher_->attach(*cxx, -1, openable_path(pid, m));
      if (!set && attach_again_later(pid, set.error().message)) continue;
      if (!set) errors_.push_back(set.error().message);
      else log("attached system-wide to " + m.path);
      system_probes_[ckey] = set ? std::move(*set) : ProbeSet();
    }
    MapEntry where;
    auto obj = attacher_->find_allocator(pid, *maps, &where);
    if (!obj || !*obj) continue;
    auto key = std::make_pair((*obj)->dev, (*obj)->inode);
    if (system_probes_.count(key)) continue;
    // Never this tool's own binary (statically linked: its malloc is in it;
    // the guardian maps it too): its own allocations would each trap into
    // the kernel, and the drain thread allocates for every event it applies
    // (a 2-job C++ build: 70% of the tool's CPU was uprobe traps, 20.6 M
    // events dropped in 110 s).
    if (key == self_exe_) continue;
    // Nor another copy of this tool (a second user, an A/B build): two
    // system-wide tracers would trace each other's every event.
    if (std::string base = where.path.substr(where.path.rfind('/') + 1); base.rfind("memtrace-bpf", 0) == 0) {
      log("not probing " + where.path + " (another memtrace-bpf)");
      system_probes_[key] = ProbeSet();
      continue;
    }
    if (o_.explain_probes) std::cerr << Attacher::explain(**obj);
    auto set = attacher_->attach(**obj, -1, openable_path(pid, where));
    if (!set) {
      if (attach_again_later(pid, set.error().message)) continue;
      errors_.push_back(set.error().message);
      system_probes_[key] = ProbeSet();
      continue;
    }
    log("attached system-wide to " + where.path);
    system_probes_[key] = std::move(*set);
  }
}

Result<void> Tracer::setup_targets() {
  if (system_wide_) {
    scan_system_allocators();
    // A machine (a container, a small guest) where nothing running maps an
    // allocator yet: a program that starts later gets its libc's probes at
    // its libc's mmap (MT_EV_LIBMAP), from then on.
    if (system_probes_.empty())
      std::cerr << "memtrace-bpf: no running process maps a known allocator yet; the first programs that map "
                   "one are traced from when its probes are in (a static program's from its exec)\n";
    return {};
  }
  for (pid_t pid : o_.pids) {
    set_target_state(pid, MT_TS_TRACED, 1);
    if (auto r = o_.inject ? inject_or_attach(pid, true) : attach_process(pid, true); !r) return r;
  }
  if (!o_.comms.empty() || o_.cgroup) {
    for (pid_t pid : all_pids()) {
      if (pid == getpid()) continue;
      auto c = read_comm(pid);
      if (!c) continue;
      // -c COMM, or a process of the --cgroup subtree (BPF takes the ones
      // that start later at their exec: filter_matches)
      bool match = std::find(o_.comms.begin(), o_.comms.end(), *c) != o_.comms.end();
      if (!match && o_.cgroup)
        if (auto cg = procfs::cgroup_of(pid)) match = procfs::cgroup_within(*cg, o_.cgroup->path);
      if (!match) continue;
      set_target_state(pid, MT_TS_TRACED, 0);
      if (auto r = o_.inject ? inject_or_attach(pid, false) : attach_process(pid, false); !r) {
        errors_.push_back(r.error().message);
        attach_failures_++;
      }
    }
  }
  if (!o_.command.empty()) {
    auto l = Launcher::start(o_.command);
    if (!l) return l.error();
    launcher_.emplace(std::move(*l));
    pid_t pid = launcher_->pid();
    procs_[pid].pid = pid;
    model_.process(pid).comm = o_.command[0].substr(o_.command[0].rfind('/') + 1).substr(0, 15);
    model_.process(pid).prelude = true;  // our code until its exec (its page faults, say)
    identify(pid, false);                // the tool's cgroup, which it inherited
    set_target_state(pid, MT_TS_PENDING, 1);
    if (auto r = launcher_->release(); !r) {
      int st = 127 << 8;
      child_status_ = st;
      return r;
    }
  }
  return {};
}

namespace {
// How the agent walks stacks (ring.h stack_used), for the attach line.
std::string stack_walk_name(uint32_t used, bool verify) {
  switch (used) {
    case MT_INJ_STACK_CFI: return verify ? "CFI rows, each compared with libunwind's" : "CFI rows";
    case MT_INJ_STACK_LIBUNWIND: return "libunwind";
    case MT_INJ_STACK_FP: return "frame pointers";
    default: return "none";
  }
}
}  // namespace

// --inject: the agent loaded into pid (src/inject); its records come
// through the session's ring (drain_injected), BPF's targets entry keeps
// pid's mmap/brk and lifecycle records coming.
Result<void> Tracer::inject_process(pid_t pid, inject::StoppedProcess* held) {
  procs_[pid].pid = pid;
  identify(pid);
  inject::SessionOptions so;
  so.held = held;
  so.agent = inject::agent_path();
  so.ring_mb = o_.inject_ring_mb;
  so.sample_bytes = o_.sample_bytes;
  // --unwind cfi: the agent walks the loader's CFI rows (issue 33; a walk
  // they cannot finish is libunwind's), or libunwind alone, or both on every
  // stack (MEMTRACE_INJECT_UNWIND, main.cpp).
  using IU = Options::InjectUnwind;
  so.stack_mode = !o_.stacks ? MT_INJ_STACK_NONE
                  : !o_.cfi  ? MT_INJ_STACK_FP
                  : o_.inject_unwind == IU::Libunwind ? MT_INJ_STACK_LIBUNWIND
                                                      : MT_INJ_STACK_CFI;
  so.verify_stacks = so.stack_mode == MT_INJ_STACK_CFI && o_.inject_unwind == IU::Verify;
  // One read of its maps for the whole attach (the allocator's detection,
  // the agent's load, the deadlock-window check, the trampolines).
  Snapshot snap(pid, &maps_reads_);
  const auto* maps = snap.maps();
  if (!maps) return snap.error();
  so.view.maps = *maps;
  if (auto r = inject_allocator(pid, *maps, &so); !r) return r.error();
  // CPython in it: the agent walks its frames (python_splice names them).
  if (mt_py_proc walk{}; python_add(pid, maps, &walk)) so.py = walk;
  auto t0 = std::chrono::steady_clock::now();
  auto s = inject::Session::start(pid, so);
  if (!s) return s.error();
  uint64_t us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  attach_us_ += us;
  attach_count_++;
  procs_[pid].attached = true;
  procs_[pid].injected = true;
  // Its mappings with the agent (and libunwind) in them, for symbolization.
  // (BPF's mmap stacks of an injected process walk frame pointers: no CFI
  // tables are loaded for it.)
  resolver_.capture(pid);
  const auto& h = (*s)->ring().hdr();
  if (!so.allocator_name.empty()) log("pid " + std::to_string(pid) + ": allocator " + so.allocator_name);
  log("injected " + so.agent + " into pid " + std::to_string(pid) + ": " + std::to_string(h.slots_hooked) +
      " GOT slots in " + std::to_string(h.objects_hooked) + " objects, stacks by " +
      stack_walk_name(h.stack_used, so.verify_stacks) +
      "; stopped " + std::to_string((*s)->load_stats().stopped_us) + " us (" + std::to_string(us) + " us in all)");
  if (so.stack_mode == MT_INJ_STACK_CFI) {
    const auto& c = (*s)->cfi_stats();
    char ms[32];
    snprintf(ms, sizeof ms, "%.1f", c.build_ms);
    log("pid " + std::to_string(pid) + ": CFI rows of " + std::to_string(c.mods) + " mappings (" +
        std::to_string(c.rows) + " rows, " + std::to_string(c.bytes >> 10) + " KiB, built in " + ms + " ms); " +
        std::to_string(c.mappings_without) + " mappings without (their frames libunwind's)" +
        (c.first_error.empty() ? "" : ": " + c.first_error));
  }
  // Its records copied out of the ring as they come, up to 4x the ring
  // held here while the model catches up (the target waits only past it).
  (*s)->start_copier(o_.inject_ring_mb << 22);
  drain_injected(true);
  retire_injected(pid);  // an earlier image's session (it exec'd): its agent is gone with that image
  injected_.push_back(std::move(*s));
  return {};
}

// --inject: the program's allocator as the BPF path finds it
// (Attacher::find_allocator: a non-glibc allocator, preloaded or linked in,
// before glibc), handed to the agent when it is not glibc's (glibc's the
// agent finds itself): every function with its role, the role functions
// first, then the allocator's other entries (C++ new/delete, sized and
// aligned deletes, mallocx...; probes::Allocator::extras). Its code is
// busy for the agent's dlopen (a thread inside may hold an arena's lock)
// when it is a library; an allocator linked into the program (je_malloc
// in the executable) has its functions' spans busy.
Result<void> Tracer::inject_allocator(pid_t pid, const std::vector<MapEntry>& maps, inject::SessionOptions* so) {
  MapEntry where;
  auto obj = attacher_->find_allocator(pid, maps, &where);
  if (!obj) return obj.error();
  if (!*obj || (*obj)->family == "glibc") return {};
  const AllocatorObject& a = **obj;
  auto runtime = [&](uint64_t file_offset) -> uint64_t {
    for (const auto& m : maps)
      if (m.exec() && m.dev == where.dev && m.inode == where.inode && file_offset >= m.offset &&
          file_offset < m.offset + (m.end - m.start))
        return m.start + (file_offset - m.offset);
    return 0;
  };
  auto add = [&](const probes::AllocatorSymbol& sym, bool primary) {
    uint64_t at = runtime(sym.file_offset);
    if (!at) return;
    so->allocator.push_back({at, static_cast<uint32_t>(sym.role), primary, sym.symbol});
    if (where.path.find(".so") == std::string::npos && sym.size) so->view.busy_extra.push_back({at, at + sym.size});
  };
  for (const auto& sym : a.alloc.symbols) add(sym, true);
  for (const auto& sym : a.alloc.extras) add(sym, false);
  if (where.path.find(".so") != std::string::npos)
    for (const auto& m : maps)
      if (m.exec() && m.dev == where.dev && m.inode == where.inode) so->view.busy_extra.push_back({m.start, m.end});
  so->allocator_name = a.family + (a.alloc.prefix.empty() ? "" : " (prefix " + a.alloc.prefix + ")") + " in " +
                       where.path + ", " + std::to_string(so->allocator.size()) + " functions";
  return {};
}

namespace {
void say_not_injected(pid_t pid, const Error& why) {
  std::cerr << "memtrace-bpf: --inject: " << why.message << "; pid " << pid << " is traced with uprobes instead\n";
}
}  // namespace

// A process the agent cannot go into (static, seccomp, ptrace refused, a
// preloaded allocator, no agent library) is traced by uprobes: one line
// says why (issue 21).
Result<void> Tracer::inject_or_attach(pid_t pid, bool given) {
  auto r = inject_process(pid);
  if (r) return r;
  say_not_injected(pid, r.error());
  return attach_process(pid, given);
}

// --inject, a process stopped by BPF at its exec (the launched program, a
// new -c process, an injected one that exec'd): run to its entry point
// under ptrace, where its libraries are loaded and relocated, and the
// agent loaded there, before any of its code runs. Until then uprobes
// record it as on the BPF path (ld.so's allocations and the libraries'
// constructors'): attached at its exec, or at BPF's stop when it maps its
// allocator (taken here under ptrace). At the entry the process is held:
// no call of its is under way; the uprobes' records so far go to the model,
// the rest of theirs is dropped (handed_over_), and the agent records from
// the next call on: nothing counted twice or lost (issue 21, item 7). A
// static program is traced by uprobes from its exec; one the agent cannot
// go into at its entry, from there (held until they are attached).
Result<void> Tracer::inject_at_exec(pid_t pid, Snapshot& snap) {
  wait_stop_landed(pid);
  if (auto r = [&]() -> Result<void> {
        if (auto c = inject::can_inject(pid); !c) return c.error();
        if (access(inject::agent_path().c_str(), R_OK) != 0) return Error::sys("agent library " + inject::agent_path());
        return {};
      }();
      !r) {
    say_not_injected(pid, r.error());
    return attach_process(pid, false, &snap);
  }
  if (auto r = attach_process(pid, false, &snap); !r) {
    errors_.push_back(r.error().message);
    attach_failures_++;
  }
  int swallowed = 0;
  auto held = inject::hold_at_entry(pid, 10000, [&] {
    swallowed++;
    if (procs_[pid].attached) return;
    Snapshot now(pid, &maps_reads_);
    if (auto r = attach_process(pid, false, &now); !r) {
      errors_.push_back(r.error().message);
      attach_failures_++;
    }
  });
  if (swallowed) swallowed_[pid] += swallowed;
  if (!held) {
    say_not_injected(pid, held.error());
    if (procs_[pid].attached) return {};
    Snapshot now(pid, &maps_reads_);
    return attach_process(pid, false, &now);
  }
  // The handover: the uprobes' records so far into the model; theirs from
  // here on (the agent's own load, then calls the agent records) dropped.
  // No stops at the agent's own mappings (libunwind) nor at later ones:
  // its dlopen hook covers new code.
  drain_events();
  handed_over_.insert(pid);
  uint32_t key = pid;
  mt_target t{};
  bpf_map_lookup_elem(bpf_map__fd(skel_->maps.targets), &key, &t);
  bool probed = procs_[pid].attached;
  set_target_state(pid, MT_TS_TRACED, t.follow | MT_FOLLOW_NO_STOP);
  Result<void> why = inject_process(pid, held->get());
  if (why) {
    procs_[pid].probes.reset();  // closed in the background; handed_over_ until then
    return why;
  }
  // Not injected: the uprobes go on from here (the call's own records dropped).
  say_not_injected(pid, why.error());
  drain_events();
  handed_over_.erase(pid);
  set_target_state(pid, MT_TS_TRACED, t.follow);
  if (probed) return {};
  Snapshot at_entry(pid, &maps_reads_);
  return attach_process(pid, false, &at_entry);
}

// --inject: an allocator call of a process handed over to its agent at its
// entry point (inject_at_exec), recorded by its uprobes, which are closed
// in the background and still fire meanwhile: the agent has the call.
bool Tracer::handed_over_call(const void* data, size_t len) const {
  if (len < sizeof(mt_event)) return false;
  const auto* e = static_cast<const mt_event*>(data);
  uint32_t k = e->h.kind;
  return (k == MT_EV_ALLOC || k == MT_EV_FREE || k == MT_EV_ALLOC_FAIL || k == MT_EV_REALLOC_FAIL) &&
         e->role < MT_ROLE_COUNT && handed_over_.count(static_cast<pid_t>(e->h.pid));
}

size_t Tracer::drain_injected(bool flush) {
  size_t n = 0;
  for (auto& s : injected_)
    n += s->drain(
        [this](const void* d, size_t len) {
          // As apply_event: a code record is the tool's own; a stack with
          // Python frames is spliced before the model and a recording see it.
          const auto* h = static_cast<const mt_hdr*>(d);
          if (len >= sizeof(mt_hdr) && h->kind == MT_EV_PYCODE) return python_code(d, len);
          std::vector<char> spliced;
          if (len >= MT_STACK_HDR_BYTES && h->kind == MT_EV_STACK && python_splice(d, len, spliced)) {
            d = spliced.data();
            len = spliced.size();
          }
          model_.apply(d, len);
          if (feat_) feat_->on_event(d, len);
        },
        SIZE_MAX, flush);
  return n;
}

void Tracer::detach_injected() {
  for (auto& s : injected_) s->detach();
  drain_injected(true);
}

void Tracer::InjectTotals::add(inject::Session& s) {
  const volatile mt_inj_hdr& h = s.ring().hdr();
  sessions++;
  drops += h.drops;
  py_cut += h.py_cut;
  malformed += s.ring().malformed();
  fork_child += h.fork_child_calls;
  full_waits += h.full_waits;
  backlog_peak = std::max<uint64_t>(backlog_peak, s.backlog_peak());
  stack_slow += h.stack_slow;
  stack_cut += h.stack_cut;
  stack_verified += h.stack_verified;
  stack_mismatch += h.stack_mismatch;
}

// A process the agent recorded ended (or exec'd into a new session): its
// records are drained (the caller's), its counters kept, its copier thread
// and its ring's mapping released. A daemon over many short processes kept
// one of each per process ended (bench/soak: 300 threads and 21 GB of
// rings in 3.5 minutes at 10 processes a second).
void Tracer::retire_injected(pid_t pid) {
  for (auto it = injected_.begin(); it != injected_.end();) {
    if ((*it)->pid() != pid) {
      ++it;
      continue;
    }
    inject_retired_.add(**it);
    (*it)->ended();
    it = injected_.erase(it);
  }
}

}  // namespace memtrace::loader
