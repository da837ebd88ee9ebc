#include "loader/bpf_object.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "memtrace_bpf.skel.h"
#include "memtrace_bpf_compat.skel.h"

namespace memtrace::loader {
namespace {

std::mutex g_log_mu;  // the objects load on two threads
std::string g_libbpf_log;

int libbpf_print(enum libbpf_print_level level, const char* fmt, va_list args) {
  if (level == LIBBPF_DEBUG) return 0;
  va_list copy;
  va_copy(copy, args);
  char buf[8192];
  int n = vsnprintf(buf, sizeof buf, fmt, copy);
  va_end(copy);
  std::lock_guard<std::mutex> lk(g_log_mu);
  if (n > 0) {
    g_libbpf_log.append(buf, std::min<size_t>(n, sizeof buf - 1));
    if (g_libbpf_log.size() > (1u << 20)) g_libbpf_log.erase(0, g_libbpf_log.size() - (1u << 19));
  }
  if (getenv("MEMTRACE_LIBBPF_VERBOSE")) return vfprintf(stderr, fmt, args);
  return 0;
}

// The two groups verified on threads of their own. Uprobe programs: the
// allocator probes; the mmap exit: its record's stack.
bool in_uprobe_group(const bpf_program* p) {
  const char* s = bpf_program__section_name(p);
  return strncmp(s, "uprobe", 6) == 0 || strncmp(s, "uretprobe", 9) == 0;
}
bool in_mmap_group(const bpf_program* p) {
  const char* n = bpf_program__name(p);
  return strcmp(n, "mt_exit_mmap") == 0 || strcmp(n, "mt_fexit_mmap") == 0;
}

// o's programs: those main would load that `keep` picks (main's own
// settings: autoload, expected attach type, copied).
void select_programs(memtrace_bpf* main, memtrace_bpf* o, bool (*keep)(const bpf_program*)) {
  bpf_program* p;
  bpf_object__for_each_program(p, o->obj) {
    const bpf_program* m = bpf_object__find_program_by_name(main->obj, bpf_program__name(p));
    bool want = m && bpf_program__autoload(m) && keep(p);
    bpf_program__set_autoload(p, want);
    bpf_program__set_autoattach(p, bpf_program__autoattach(m));
    if (want) bpf_program__set_expected_attach_type(p, bpf_program__expected_attach_type(m));
  }
}

// Every map of o is main's (created by main's load).
int reuse_maps(memtrace_bpf* main, memtrace_bpf* o) {
  bpf_map* m;
  bpf_object__for_each_map(m, o->obj) {
    bpf_map* src = bpf_object__find_map_by_name(main->obj, bpf_map__name(m));
    if (!src || bpf_map__fd(src) < 0) return -ENOENT;
    if (int err = bpf_map__reuse_fd(m, bpf_map__fd(src)); err) return err;
  }
  return 0;
}

// memtrace_bpf__load, with MEMTRACE_VERIFIER_STATS=1 printing each loaded
// program's verifier statistics (instructions processed, states, time) on
// stderr: where a launch's load goes (docs/startup-cost.md).
// MEMTRACE_VERIFIER_STATS=DIR (a directory): each program's whole log
// (level 2: every instruction the verifier walked, with its state) in
// DIR/NAME.log as well.
int load_object(memtrace_bpf* o) {
  const char* want = getenv("MEMTRACE_VERIFIER_STATS");
  if (!want) return memtrace_bpf__load(o);
  std::string dir = strcmp(want, "1") == 0 ? "" : want;
  std::vector<std::pair<bpf_program*, std::vector<char>>> logs;
  bpf_program* p;
  bpf_object__for_each_program(p, o->obj) if (bpf_program__autoload(p))
      logs.emplace_back(p, std::vector<char>(dir.empty() ? 1 << 16 : 256u << 20));
  for (auto& [prog, buf] : logs) {
    bpf_program__set_log_level(prog, dir.empty() ? 4 : 4 | 2);  // BPF_LOG_STATS, BPF_LOG_LEVEL2
    bpf_program__set_log_buf(prog, buf.data(), buf.size());
  }
  int err = memtrace_bpf__load(o);
  std::lock_guard<std::mutex> lk(g_log_mu);
  for (auto& [prog, buf] : logs) {
    size_t len = strnlen(buf.data(), buf.size());
    if (!dir.empty())
      if (FILE* f = fopen((dir + "/" + bpf_program__name(prog) + ".log").c_str(), "w")) {
        fwrite(buf.data(), 1, len, f);
        fclose(f);
      }
    std::istringstream is(std::string(buf.data(), len));
    std::string stats;
    for (std::string l; std::getline(is, l);)
      if (l.rfind("processed ", 0) == 0 || l.rfind("verification time", 0) == 0) stats += " | " + l;
    fprintf(stderr, "memtrace-bpf: verifier %s%s\n", bpf_program__name(prog), stats.c_str());
  }
  return err;
}

}  // namespace

// The full object, or the compat one (kernels before 5.17) through the same
// skeleton: bpf/skeletons_agree.py checks at build time that the compat
// object has every map and program the skeleton names and the same
// read-only variables.
memtrace_bpf* open_skeleton(bool full) {
  auto* obj = static_cast<memtrace_bpf*>(calloc(1, sizeof(memtrace_bpf)));
  if (!obj) return nullptr;
  int err = memtrace_bpf__create_skeleton(obj);
  if (!err && !full) obj->skeleton->data = const_cast<void*>(memtrace_bpf_compat__elf_bytes(&obj->skeleton->data_sz));
  if (!err) err = bpf_object__open_skeleton(obj->skeleton, nullptr);
  if (err) {
    memtrace_bpf__destroy(obj);
    errno = -err;
    return nullptr;
  }
  return obj;
}

void install_libbpf_print() { libbpf_set_print(libbpf_print); }

void clear_libbpf_log() {
  std::lock_guard<std::mutex> lk(g_log_mu);
  g_libbpf_log.clear();
}

// "the kernel refused BPF program 'mt_alloc_enter' (Permission denied):
// combined stack size of 4 calls is 544. Too large": the program libbpf says
// failed, and the last lines of its verifier log.
std::string load_failure(int err) {
  std::string log;
  {
    std::lock_guard<std::mutex> lk(g_log_mu);
    log = g_libbpf_log;
  }
  std::string prog;
  size_t at = log.rfind("BPF program load failed");
  if (at != std::string::npos) {
    size_t q2 = log.rfind('\'', at), q1 = q2 == std::string::npos ? q2 : log.rfind('\'', q2 - 1);
    if (q1 != std::string::npos) prog = log.substr(q1 + 1, q2 - q1 - 1);
  }
  if (prog.empty()) {
    // libbpf's first warning says what went wrong (a map it could not
    // create, a relocation); the later ones only that the object failed.
    std::string first;
    std::istringstream is(log);
    for (std::string l; std::getline(is, l) && first.empty();)
      if (!l.empty()) first = l.rfind("libbpf: ", 0) == 0 ? l.substr(8) : l;
    return "load BPF programs: " + std::string(strerror(err)) + (first.empty() ? "" : " (libbpf: " + first + ")");
  }
  std::vector<std::string> lines;
  size_t b = log.find("-- BEGIN PROG LOAD LOG --", at), e = log.find("-- END PROG LOAD LOG --", at);
  if (b != std::string::npos && e != std::string::npos && e > b) {
    std::istringstream is(log.substr(b, e - b));
    for (std::string l; std::getline(is, l);)
      if (!l.empty() && l.rfind("--", 0) != 0 && l.rfind("processed ", 0) != 0 &&
          l.rfind("verification time", 0) != 0 && l.rfind("stack depth", 0) != 0)
        lines.push_back(l);
  }
  std::string why;
  for (size_t i = lines.size() > 3 ? lines.size() - 3 : 0; i < lines.size(); i++)
    why += (why.empty() ? "" : " | ") + lines[i];
  return "the kernel refused BPF program '" + prog + "' (" + strerror(err) + ")" + (why.empty() ? "" : ": " + why) +
         " (MEMTRACE_LIBBPF_VERBOSE=1 prints the verifier's whole log)";
}

Result<void> load_objects(BpfObjects& objs, bool full, bool parallel, bool defer_uprobes) {
  memtrace_bpf* main = objs.main;
  if (parallel) {
    objs.uprobes = open_skeleton(full);
    objs.mmap = open_skeleton(full);
    if (!objs.uprobes || !objs.mmap) return Error::sys("open BPF object");
    select_programs(main, objs.uprobes, in_uprobe_group);
    select_programs(main, objs.mmap, in_mmap_group);
    bpf_program* p;
    bpf_object__for_each_program(p, main->obj) if (in_uprobe_group(p) || in_mmap_group(p))
        bpf_program__set_autoload(p, false);
  }
  clear_libbpf_log();
  if (int err = load_object(main); err) return Error::msg(load_failure(-err));
  if (!parallel) return {};
  for (memtrace_bpf* o : {objs.uprobes, objs.mmap})
    if (int err = reuse_maps(main, o); err) return Error::sys("share the BPF maps between objects", -err);
  if (defer_uprobes) {
    BpfObjects* o = &objs;
    objs.uprobe_loader = std::thread([o] {
      o->uprobe_err = load_object(o->uprobes);
      o->uprobes_loaded = true;
    });
    if (int err = load_object(objs.mmap); err) return Error::msg(load_failure(-err));
    return {};
  }
  int mmap_err = 0;
  std::thread t([&] { mmap_err = load_object(objs.mmap); });
  int up_err = load_object(objs.uprobes);
  t.join();
  if (up_err) return Error::msg(load_failure(-up_err));
  if (mmap_err) return Error::msg(load_failure(-mmap_err));
  return {};
}

Result<void> wait_uprobes(BpfObjects& objs) {
  if (objs.uprobe_loader.joinable()) objs.uprobe_loader.join();
  if (objs.uprobe_err) return Error::msg(load_failure(-objs.uprobe_err));
  return {};
}

size_t loaded_programs(const BpfObjects& objs) {
  size_t n = 0;
  for (memtrace_bpf* o : {objs.main, objs.uprobes, objs.mmap}) {
    if (!o) continue;
    bpf_program* p;
    bpf_object__for_each_program(p, o->obj) n += bpf_program__fd(p) >= 0;
  }
  return n;
}

void destroy_objects(BpfObjects& objs) {
  if (objs.uprobe_loader.joinable()) {
    if (objs.uprobes_loaded) {
      objs.uprobe_loader.join();
    } else {  // still verifying: left to the process's end (the kernel stops at its signal)
      objs.uprobe_loader.detach();
      objs.uprobes = nullptr;
    }
  }
  for (memtrace_bpf** o : {&objs.uprobes, &objs.mmap, &objs.main})
    if (*o) {
      memtrace_bpf__destroy(*o);
      *o = nullptr;
    }
}

}  // namespace memtrace::loader
