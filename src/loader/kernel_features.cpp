#include "loader/kernel_features.h"

#include <bpf/bpf.h>
#include <bpf/btf.h>
#include <bpf/libbpf.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace memtrace::loader {
namespace {

std::string read_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

// "none [integrity] confidentiality" -> "integrity"
std::string lockdown_mode() {
  std::string s = read_line("/sys/kernel/security/lockdown");
  auto a = s.find('['), b = s.find(']');
  return a != std::string::npos && b != std::string::npos && b > a ? s.substr(a + 1, b - a - 1) : "";
}

void read_caps(KernelFeatures& k) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    unsigned long long caps = std::stoull(line.substr(7), nullptr, 16);
    k.cap_sys_admin = caps >> 21 & 1;
    k.cap_perfmon = caps >> 38 & 1;
    k.cap_bpf = caps >> 39 & 1;
  }
}

bool helper(bpf_func_id id) { return libbpf_probe_bpf_helper(BPF_PROG_TYPE_KPROBE, id, nullptr) == 1; }

// Number of arguments a BTF tracepoint passes (btf_trace_NAME is a typedef of
// a pointer to its prototype, whose first parameter is the tracepoint's
// data pointer). -1: no such tracepoint.
int tp_args(const btf* vmlinux, const std::string& tp) {
  int id = btf__find_by_name_kind(vmlinux, ("btf_trace_" + tp).c_str(), BTF_KIND_TYPEDEF);
  if (id < 0) return -1;
  const btf_type* t = btf__type_by_id(vmlinux, id);
  if (t) t = btf__type_by_id(vmlinux, t->type);  // the pointer
  if (t && btf_is_ptr(t)) t = btf__type_by_id(vmlinux, t->type);
  if (!t || !btf_is_func_proto(t)) return -1;
  return static_cast<int>(btf_vlen(t)) - 1;
}

bool enum_has(const btf* vmlinux, const char* type, const char* value) {
  int id = btf__find_by_name_kind(vmlinux, type, BTF_KIND_ENUM);
  if (id < 0) return false;
  const btf_type* t = btf__type_by_id(vmlinux, id);
  const struct btf_enum* e = btf_enum(t);
  for (unsigned i = 0; i < btf_vlen(t); i++)
    if (strcmp(btf__name_by_offset(vmlinux, e[i].name_off), value) == 0) return true;
  return false;
}

// The system-call functions the fentry/fexit programs hook, by this
// architecture's wrapper names (bpf/mmap.bpf.h MT_SYS).
#if defined(__aarch64__)
#define MT_SYS_PREFIX "__arm64_sys_"
#else
#define MT_SYS_PREFIX "__x64_sys_"
#endif
constexpr const char* kFexitTargets[] = {MT_SYS_PREFIX "mmap", MT_SYS_PREFIX "munmap", MT_SYS_PREFIX "mremap",
                                         MT_SYS_PREFIX "brk", "schedule_tail"};

// fexit works on this kernel: every target has BTF and a trivial program
// attaches to schedule_tail (BPF trampolines on kernel functions: x86-64
// 5.5; arm64 only with ftrace direct calls, 6.4, commit 2aa6ac03516d "arm64:
// ftrace: Add direct call support": before it the attach fails with
// ENOTSUPP). The attach is the only reliable test; it lasts a few
// milliseconds.
bool probe_fexit(const btf* vmlinux, const std::string& release) {
#if defined(__aarch64__)
  // arm64: only with ftrace direct calls (6.4). On Debian's arm64 6.1 the
  // trial attach failed, as it must there, and afterwards the tool's own new
  // tasks crashed at address 0 at the end of -p, -c and system-wide runs
  // under qemu (the guest's bpf.* tests; not understood, docs/kernels.md):
  // not even tried before 6.4.
  int major = 0, minor = 0;
  if (sscanf(release.c_str(), "%d.%d", &major, &minor) != 2 || major < 6 || (major == 6 && minor < 4)) return false;
#else
  (void)release;
#endif
  for (const char* f : kFexitTargets)
    if (btf__find_by_name_kind(vmlinux, f, BTF_KIND_FUNC) <= 0) return false;
  int id = btf__find_by_name_kind(vmlinux, "schedule_tail", BTF_KIND_FUNC);
  const bpf_insn insns[] = {
      {.code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = BPF_REG_0, .src_reg = 0, .off = 0, .imm = 0},
      {.code = BPF_JMP | BPF_EXIT, .dst_reg = 0, .src_reg = 0, .off = 0, .imm = 0},
  };
  LIBBPF_OPTS(bpf_prog_load_opts, opts, .expected_attach_type = BPF_TRACE_FEXIT, .attach_btf_id = static_cast<__u32>(id));
  int prog = bpf_prog_load(BPF_PROG_TYPE_TRACING, "mt_probe_fexit", "GPL", insns, 2, &opts);
  if (prog < 0) return false;
  int link = bpf_raw_tracepoint_open(nullptr, prog);
  if (link >= 0) close(link);
  close(prog);
  return link >= 0;
}

std::string why_no_bpf(const KernelFeatures& k, int err) {
  std::ostringstream os;
  os << "bpf(2) refused to create a map (" << strerror(err) << ")";
  if (err == EPERM || err == EACCES) {
    if (!k.cap_sys_admin && !k.cap_bpf)
      os << ": this process has neither CAP_BPF nor CAP_SYS_ADMIN (not root, or a container without them)";
    else if (k.lockdown == "confidentiality")
      os << ": kernel lockdown is in confidentiality mode, which forbids BPF programs that read memory";
    else if (!k.cap_sys_admin && !k.cap_perfmon)
      os << ": this process has CAP_BPF but not CAP_PERFMON, which tracing programs also need";
    else
      os << ": BPF is forbidden here (a seccomp filter or an LSM policy, e.g. a container runtime's)";
  } else if (err == ENOSYS) {
    os << ": the kernel was built without CONFIG_BPF_SYSCALL";
  }
  return os.str();
}

}  // namespace

KernelFeatures probe_kernel() {
  KernelFeatures k;
  struct utsname u;
  if (uname(&u) == 0) k.release = u.release;
  k.lockdown = lockdown_mode();
  std::string ubd = read_line("/proc/sys/kernel/unprivileged_bpf_disabled");
  if (!ubd.empty()) k.unprivileged_bpf_disabled = std::atoi(ubd.c_str());
  read_caps(k);

  int fd = bpf_map_create(BPF_MAP_TYPE_ARRAY, "mt_probe", 4, 8, 1, nullptr);
  if (fd < 0) {
    k.bpf_error = why_no_bpf(k, errno);
  } else {
    close(fd);
    k.bpf = true;
  }
  k.uprobes = access("/sys/bus/event_source/devices/uprobe/type", R_OK) == 0 ||
              access("/sys/kernel/tracing/uprobe_events", F_OK) == 0 ||
              access("/sys/kernel/debug/tracing/uprobe_events", F_OK) == 0;

  btf* vmlinux = btf__load_vmlinux_btf();
  if (libbpf_get_error(vmlinux)) vmlinux = nullptr;
  k.btf = vmlinux != nullptr;
  if (vmlinux) {
    k.sched_tp_btf = tp_args(vmlinux, "sched_process_exec") >= 3 && tp_args(vmlinux, "sched_process_fork") >= 2 &&
                     tp_args(vmlinux, "sched_process_exit") >= 1;
    k.exit_group_dead = tp_args(vmlinux, "sched_process_exit") >= 2;
#if defined(__aarch64__)
    // No page_fault_user tracepoint on arm64: the fault program is a kprobe
    // on handle_mm_fault (bpf/faults.bpf.h), whose flags it reads by CO-RE
    // (enum fault_flag, 5.17+; before, the values of 5.10's #defines).
    k.page_fault_tp = btf__find_by_name_kind(vmlinux, "handle_mm_fault", BTF_KIND_FUNC) > 0 &&
                      (access("/sys/bus/event_source/devices/kprobe/type", R_OK) == 0 ||
                       access("/sys/kernel/tracing/kprobe_events", F_OK) == 0 ||
                       access("/sys/kernel/debug/tracing/kprobe_events", F_OK) == 0);
#else
    k.page_fault_tp = tp_args(vmlinux, "page_fault_user") >= 3;
#endif
    k.uprobe_multi = enum_has(vmlinux, "bpf_attach_type", "BPF_TRACE_UPROBE_MULTI");
    if (k.bpf) k.syscall_fexit = probe_fexit(vmlinux, k.release);
    btf__free(vmlinux);
  }
  if (k.bpf) {
    k.ringbuf = libbpf_probe_bpf_map_type(BPF_MAP_TYPE_RINGBUF, nullptr) == 1;
    k.attach_cookie = helper(BPF_FUNC_get_attach_cookie);
    k.bpf_loop = helper(BPF_FUNC_loop);
    k.find_vma = helper(BPF_FUNC_find_vma);
    k.task_storage = libbpf_probe_bpf_map_type(BPF_MAP_TYPE_TASK_STORAGE, nullptr) == 1 &&
                     helper(BPF_FUNC_task_storage_get);
    k.task_btf = helper(BPF_FUNC_get_current_task_btf);
    k.task_pt_regs = helper(BPF_FUNC_task_pt_regs);
  }
  return k;
}

std::string KernelFeatures::full_bpf_missing() const {
  std::string m;
  auto add = [&](bool have, const char* what) {
    if (!have) m += (m.empty() ? "" : ", ") + std::string(what);
  };
  add(bpf_loop, "bpf_loop (5.17)");
  add(find_vma, "bpf_find_vma (5.17)");
  add(attach_cookie, "BPF cookies (5.15)");
  add(task_pt_regs, "bpf_task_pt_regs (5.15)");
  add(task_storage, "task storage in tracing programs (5.11)");
  add(task_btf, "bpf_get_current_task_btf (5.11)");
  return m;
}

bool choose_full_bpf(const KernelFeatures& k) {
  if (const char* v = getenv("MEMTRACE_BPF_VARIANT"); v && *v) return std::string(v) != "compat";
  return k.full_bpf();
}

bool choose_syscall_fexit(const KernelFeatures& k) {
  if (!choose_full_bpf(k)) return false;
  if (const char* v = getenv("MEMTRACE_SYSCALL_HOOKS"); v && *v) return std::string(v) == "fexit" && k.syscall_fexit;
  return k.syscall_fexit;
}

std::vector<std::string> describe(const KernelFeatures& k) {
  std::vector<std::string> out;
  auto line = [&](bool ok, const std::string& what, const std::string& how) {
    out.push_back(std::string(ok ? "ok       " : "missing  ") + what + ": " + how);
  };
  auto choice = [&](bool best, const std::string& what, const std::string& yes, const std::string& no) {
    out.push_back(std::string(best ? "ok       " : "fallback ") + what + ": " + (best ? yes : no));
  };
  out.push_back("kernel   " + k.release + (k.lockdown.empty() ? "" : ", lockdown " + k.lockdown));
  line(k.bpf, "BPF", k.bpf ? "bpf(2) usable" : k.bpf_error);
  line(k.btf, "BTF", k.btf ? "/sys/kernel/btf/vmlinux (CO-RE, BTF tracepoints)"
                           : "no /sys/kernel/btf/vmlinux: the kernel needs CONFIG_DEBUG_INFO_BTF=y");
  if (k.bpf)
    line(k.ringbuf, "ring buffer", k.ringbuf ? "BPF_MAP_TYPE_RINGBUF" : "BPF_MAP_TYPE_RINGBUF needs kernel 5.8");
  line(k.uprobes, "uprobes", k.uprobes ? "uprobe PMU" : "no uprobe PMU and no uprobe_events: CONFIG_UPROBE_EVENTS is off");
  if (k.btf)
    line(k.sched_tp_btf, "process events",
         k.sched_tp_btf ? "sched_process_exec/fork/exit (BTF tracepoints)" : "no BTF for sched_process_exec/fork/exit");
  if (!k.bpf) return out;
  bool full = choose_full_bpf(k);
  choice(full, "BPF object", "full (bpf_loop, bpf_find_vma, BPF cookies, task storage)",
         "compat, for kernels before 5.17: this kernel lacks " +
             (k.full_bpf() ? std::string("nothing (MEMTRACE_BPF_VARIANT=compat)") : k.full_bpf_missing()));
  if (full)
    choice(k.uprobe_multi, "uprobe attach", "uprobe_multi links (one link per process for all entry probes)",
           "one perf-event uprobe per probe and process, with BPF cookies (uprobe_multi links need 6.6)");
  else
    choice(false, "uprobe attach", "",
           "one perf-event uprobe per probe and process, one program per allocator function, probes where the "
           "return address is at [rsp]");
#if defined(__x86_64__)
  // Before 5.17 the same tables walk in a chain of tail calls (bpf/unwind_chain.bpf.h).
  choice(full, "stacks", "complete, CFI (.eh_frame) unwinding in BPF (frame loop: bpf_loop)",
         "complete, CFI (.eh_frame) unwinding in BPF, the frame loop a chain of tail calls (no bpf_loop before "
         "5.17)");
#else
  choice(full, "stacks", "complete, CFI (.eh_frame) unwinding in BPF",
         "frame pointers only (the CFI unwinder's frame loop needs bpf_loop, 5.17)");
#endif
  choice(choose_syscall_fexit(k), "system calls",
         "fexit on " MT_SYS_PREFIX "mmap/munmap/mremap/brk and schedule_tail (no syscalls:* tracepoint: other system "
         "calls keep their fast path)",
         std::string("syscalls:sys_enter/exit_mmap, munmap, mremap, brk, sys_exit_clone/fork (while they are attached "
                     "every system call of every task takes the tracing path; ") +
             (!full ? "the compat object)" : k.syscall_fexit ? "MEMTRACE_SYSCALL_HOOKS=tracepoint)"
                                                             : "no BPF trampoline for them on this kernel)"));
  choice(full, "in-flight calls", "task local storage", "hash map keyed by thread id");
  choice(k.exit_group_dead, "process exit", "sched_process_exit's group_dead",
         "last thread found by signal->live (group_dead is newer than this kernel)");
#if defined(__aarch64__)
  if (k.page_fault_tp)
    choice(false, "page faults", "",
           "a kprobe on handle_mm_fault (arm64 has no page_fault_user tracepoint): faults that end in SIGSEGV "
           "are not seen; --rearm is off (not supported on aarch64 yet: single-step helper)");
  else
    line(false, "page faults", "no kprobe on handle_mm_fault (no BTF for it or no kprobe PMU): --faults is off");
#else
  if (k.page_fault_tp)
    choice(full, "page faults", "page_fault_user, checked against the VMA (bpf_find_vma)",
           "page_fault_user without the VMA check: faults that end in SIGSEGV are not flagged, --rearm is off "
           "(bpf_find_vma needs 5.17)");
  else
    line(false, "page faults", "no exceptions:page_fault_user tracepoint: --faults is off");
#endif
  return out;
}

}  // namespace memtrace::loader
