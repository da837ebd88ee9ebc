// memtrace-floor: run a command with EMPTY BPF programs on the allocator
// probes memtrace-bpf uses (same objects, same roles, same offsets), attached
// to that process only. The time it takes is the floor no uprobe tracer can go
// below (issue 4).
//
//   memtrace-floor [--offsets zero|chosen] [--explain] -- CMD [ARGS...]
//
// The command is started under ptrace, stepped syscall by syscall until ld.so
// has mapped its allocator (a preloaded jemalloc/tcmalloc/mimalloc wins over
// glibc), the probes are attached with pid = child, then it is released.
// Prints "FLOOR_CHILD_SECONDS=<s>" (release to exit) on stderr; exits with the
// command's status.
#include <bpf/libbpf.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "elf/elf_file.h"
#include "floor.skel.h"
#include "probes/allocators.h"

namespace pr = memtrace::probes;

namespace {

struct SkelDeleter {
  void operator()(struct floor* s) const { floor__destroy(s); }
};

bool ensure_tracefs() {
  struct stat st;
  if (stat("/sys/kernel/tracing/events", &st) == 0) return true;
  if (mount("nodev", "/sys/kernel/tracing", "tracefs", 0, nullptr) == 0) return true;
  perror("floor: mount tracefs on /sys/kernel/tracing");
  return false;
}

struct Mapped {
  std::string path;
  bool exec = false;
};

std::vector<Mapped> read_maps(pid_t pid) {
  std::vector<Mapped> out;
  std::ifstream f("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream is(line);
    std::string range, perms, off, dev, inode, path;
    is >> range >> perms >> off >> dev >> inode;
    std::getline(is >> std::ws, path);
    if (path.empty() || path[0] != '/') continue;
    out.push_back({path, perms.size() > 2 && perms[2] == 'x'});
  }
  return out;
}

struct Found {
  std::string path;
  pr::Allocator alloc;
};

// The allocator object the process uses, once glibc (always loaded last by
// ld.so for a dynamic program) is mapped executable. nullopt: not yet.
std::map<std::string, std::optional<pr::Allocator>> g_cache;
std::optional<Found> find_allocator(pid_t pid, bool* libc_seen) {
  std::optional<Found> glibc, other;
  *libc_seen = false;
  for (const auto& m : read_maps(pid)) {
    if (!m.exec || m.path.find("/ld-linux") != std::string::npos) continue;
    auto it = g_cache.find(m.path);
    if (it == g_cache.end()) {
      std::optional<pr::Allocator> a;
      auto elf = memtrace::elf::ElfFile::open("/proc/" + std::to_string(pid) + "/root" + m.path);
      if (elf) a = pr::find_allocator_symbols(*elf);
      it = g_cache.emplace(m.path, std::move(a)).first;
    }
    if (!it->second) continue;
    if (it->second->family == pr::Family::kGlibc) {
      *libc_seen = true;
      if (!glibc) glibc = Found{m.path, *it->second};
    } else if (!other) {
      other = Found{m.path, *it->second};
    }
  }
  if (other && *libc_seen) return other;
  return glibc;
}

}  // namespace

int main(int argc, char** argv) {
  bool chosen = true, explain = false;
  int i = 1;
  for (; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--") {
      i++;
      break;
    } else if (a == "--offsets" && i + 1 < argc) {
      std::string v = argv[++i];
      if (v != "zero" && v != "chosen") {
        std::cerr << "floor: --offsets zero|chosen\n";
        return 2;
      }
      chosen = v == "chosen";
    } else if (a == "--explain") {
      explain = true;
    } else {
      break;
    }
  }
  if (i >= argc) {
    std::cerr << "usage: memtrace-floor [--offsets zero|chosen] [--explain] -- CMD [ARGS...]\n";
    return 2;
  }
  if (geteuid() != 0) {
    std::cerr << "floor: must run as root\n";
    return 2;
  }
  ensure_tracefs();

  std::unique_ptr<struct floor, SkelDeleter> skel(floor__open_and_load());
  if (!skel) {
    std::cerr << "floor: load BPF object: " << strerror(errno) << "\n";
    return 1;
  }

  pid_t child = fork();
  if (child == 0) {
    ptrace(PTRACE_TRACEME, 0, nullptr, nullptr);
    execvp(argv[i], argv + i);
    perror("floor: exec");
    _exit(127);
  }
  int st = 0;
  waitpid(child, &st, 0);  // exec stop (SIGTRAP)
  if (!WIFSTOPPED(st)) {
    std::cerr << "floor: child did not stop at exec\n";
    return 1;
  }
  ptrace(PTRACE_SETOPTIONS, child, nullptr, PTRACE_O_TRACESYSGOOD | PTRACE_O_EXITKILL);

  std::optional<Found> found;
  int deliver = 0;
  for (int steps = 0; steps < 4000; steps++) {
    bool libc_seen = false;
    found = find_allocator(child, &libc_seen);
    if (found && libc_seen) break;
    found.reset();
    if (ptrace(PTRACE_SYSCALL, child, nullptr, reinterpret_cast<void*>(static_cast<long>(deliver))) != 0) break;
    deliver = 0;
    if (waitpid(child, &st, 0) < 0 || !WIFSTOPPED(st)) break;
    int sig = WSTOPSIG(st);
    if (sig != (SIGTRAP | 0x80) && sig != SIGTRAP) deliver = sig;
  }
  if (!WIFSTOPPED(st)) {
    std::cerr << "floor: child exited before its allocator was mapped\n";
    return 1;
  }

  std::vector<bpf_link*> links;
  int entries = 0, returns = 0;
  if (!found) {
    std::cerr << "floor: no allocator found in the child's mappings; running it without probes\n";
  } else {
    if (explain) std::cerr << pr::explain(found->alloc, found->path);
    std::string open_path = "/proc/" + std::to_string(child) + "/root" + found->path;
    for (const auto& s : found->alloc.symbols) {
      if (!s.alias_of.empty()) continue;
      uint64_t entry_off = chosen ? s.placement.offset : 0;
      uint64_t ret_off = chosen ? pr::return_probe_offset(s.placement) : 0;
      LIBBPF_OPTS(bpf_uprobe_opts, eo, .retprobe = false);
      bpf_link* l = bpf_program__attach_uprobe_opts(skel->progs.floor_enter, child, open_path.c_str(),
                                                    s.file_offset + entry_off, &eo);
      if (!l) {
        std::cerr << "floor: attach uprobe " << s.symbol << "+" << entry_off << " in " << found->path << ": "
                  << strerror(errno) << "\n";
        continue;
      }
      links.push_back(l);
      entries++;
      if (!pr::has_return_probe(s.role)) continue;
      LIBBPF_OPTS(bpf_uprobe_opts, ro, .retprobe = true);
      l = bpf_program__attach_uprobe_opts(skel->progs.floor_exit, child, open_path.c_str(), s.file_offset + ret_off,
                                          &ro);
      if (!l) {
        std::cerr << "floor: attach uretprobe " << s.symbol << "+" << ret_off << ": " << strerror(errno) << "\n";
        continue;
      }
      links.push_back(l);
      returns++;
    }
    std::cerr << "floor: " << entries << " uprobes + " << returns << " uretprobes on " << found->path
              << " (offsets " << (chosen ? "chosen" : "zero") << ") pid " << child << "\n";
  }

  auto t0 = std::chrono::steady_clock::now();
  ptrace(PTRACE_DETACH, child, nullptr, reinterpret_cast<void*>(static_cast<long>(deliver)));
  waitpid(child, &st, 0);
  auto t1 = std::chrono::steady_clock::now();
  fprintf(stderr, "FLOOR_CHILD_SECONDS=%.6f\n", std::chrono::duration<double>(t1 - t0).count());

  // Each link's destruction waits for an RCU grace period: do them at once.
  std::vector<std::thread> ts;
  for (bpf_link* l : links) ts.emplace_back([l] { bpf_link__destroy(l); });
  for (auto& t : ts) t.join();
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return 1;
}
