#include "loader/shared_uprobes.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <fcntl.h>
#include <linux/perf_event.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

namespace memtrace::loader::shared_uprobes {
namespace {

struct Event {
  std::string name;  // pN / rN
  int id = -1;
  Link carrier;
  int refused = 0;  // errno of the first process's open: the kernel refuses this offset
  std::string broken;  // it could not be made: why (every process takes the PMU)
};

std::mutex g_mu;
std::map<std::tuple<uint64_t, uint64_t, uint64_t, bool>, Event> g_events;  // (dev, inode, offset, ret)
int g_next = 0;

// tracefs's directory ("" if it has no uprobe_events we may write), found
// once (also in the guardian, a fork from before the first attach).
const std::string& tracefs_dir() {
  static const std::string dir = [] {
    for (const char* d : {"/sys/kernel/tracing", "/sys/kernel/debug/tracing"})
      if (access((std::string(d) + "/uprobe_events").c_str(), W_OK) == 0) return std::string(d);
    return std::string();
  }();
  return dir;
}
const std::string& events_file() {
  static const std::string f = tracefs_dir().empty() ? "" : tracefs_dir() + "/uprobe_events";
  return f;
}

std::string group_of(pid_t owner) { return "memtrace_" + std::to_string(owner); }

// Whom the carriers target: kthreadd (a kernel thread: no mm, so no
// process's hit is admitted by it), else the tool itself, whose static
// binary is no probed file but when a run probes it (--check; a second
// instance tracing the first).
pid_t carrier_target() {
  static const pid_t pid = [] {
    std::ifstream f("/proc/2/status");
    std::string line, name;
    bool ppid0 = false;
    while (std::getline(f, line)) {
      if (line.rfind("Name:", 0) == 0) name = line.substr(line.find_first_not_of(" \t", 5));
      if (line.rfind("PPid:", 0) == 0) ppid0 = strtol(line.c_str() + 5, nullptr, 10) == 0;
    }
    return name == "kthreadd" && ppid0 ? 2 : getpid();
  }();
  return pid;
}

int perf_open(int id, pid_t pid) {
  perf_event_attr attr{};
  attr.size = sizeof attr;
  attr.type = PERF_TYPE_TRACEPOINT;
  attr.config = static_cast<uint64_t>(id);
  return static_cast<int>(syscall(__NR_perf_event_open, &attr, pid, -1, -1, PERF_FLAG_FD_CLOEXEC));
}

// One write per line: the kernel parses each write as one command.
int write_line(int fd, const std::string& line) {
  return write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) ? 0 : errno;
}

// The events of the memtrace groups in uprobe_events: (group, event).
std::vector<std::pair<std::string, std::string>> listed() {
  std::vector<std::pair<std::string, std::string>> out;
  std::ifstream f(events_file());
  std::string line;
  while (std::getline(f, line)) {
    // "p:memtrace_123/p0 /usr/lib/x86_64-linux-gnu/libc.so.6:0x0000000000098930"
    size_t colon = line.find(':'), slash = line.find('/'), sp = line.find(' ');
    if (colon == std::string::npos || slash == std::string::npos || sp == std::string::npos || slash > sp) continue;
    std::string group = line.substr(colon + 1, slash - colon - 1);
    if (group.rfind("memtrace_", 0) == 0) out.emplace_back(group, line.substr(slash + 1, sp - slash - 1));
  }
  return out;
}

void remove_listed(const std::vector<std::pair<std::string, std::string>>& evs) {
  std::vector<std::string> lines;
  for (const auto& [g, e] : evs) lines.push_back("-:" + g + "/" + e + "\n");
  remove_events(lines);
}

// Events of tools that are gone (SIGKILL before their guardian could remove
// them; a guest powered off). One still open somewhere is refused (EBUSY).
void remove_stale() {
  std::vector<std::pair<std::string, std::string>> stale;
  for (const auto& ge : listed()) {
    long pid = strtol(ge.first.c_str() + strlen("memtrace_"), nullptr, 10);
    if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) stale.push_back(ge);
  }
  remove_listed(stale);
}

}  // namespace

bool available() {
  static const bool ok = [] {
    if (const char* a = getenv("MEMTRACE_UPROBE_ATTACH"); a && std::string(a) == "perf-pmu") return false;
    if (events_file().empty()) return false;
    remove_stale();
    return true;
  }();
  return ok;
}

Result<Link> open_for(pid_t pid, const std::string& path, uint64_t dev, uint64_t inode, uint64_t offset, bool ret,
                      bpf_program* prog, uint64_t cookie, bool with_cookie) {
  const char* kind = ret ? "uretprobe" : "uprobe";
  auto where = [&] { return std::string(kind) + " at +" + std::to_string(offset) + " in " + path; };
  // A failure to make the event has no errno (the caller takes the PMU
  // instead); one of the process's own open has the kernel's.
  std::lock_guard<std::mutex> lk(g_mu);
  Event& ev = g_events[{dev, inode, offset, ret}];
  auto made = [&ev](Error e) {
    ev.broken = e.message;
    return Error::msg(e.message);
  };
  if (!ev.broken.empty()) return Error::msg(ev.broken);
  if (ev.id < 0) {
    // The command line is split at white space: such a path goes through the PMU.
    if (path.find_first_of(" \t\n") != std::string::npos) return made(Error::msg("shared " + where() + ": white space in the path"));
    std::string name = (ret ? "r" : "p") + std::to_string(g_next++);
    char cmd[4200];
    int n = snprintf(cmd, sizeof cmd, "%c:%s/%s %s:0x%" PRIx64 "\n", ret ? 'r' : 'p', group_of(getpid()).c_str(),
                     name.c_str(), path.c_str(), offset);
    if (n <= 0 || n >= static_cast<int>(sizeof cmd)) return made(Error::msg("shared " + where() + ": path too long"));
    int fd = open(events_file().c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) return made(Error::sys("open " + events_file()));
    int err = write_line(fd, cmd);
    close(fd);
    if (err) return made(Error::sys("create the shared " + where() + " (" + events_file() + ")", err));
    int id = -1;
    if (FILE* f = fopen((tracefs_dir() + "/events/" + group_of(getpid()) + "/" + name + "/id").c_str(), "re")) {
      if (fscanf(f, "%d", &id) != 1) id = -1;
      fclose(f);
    }
    if (id < 0) return made(Error::msg("shared " + where() + ": no id in " + tracefs_dir() + "/events/" + group_of(getpid())));
    // The carrier: one process no hit comes from.
    int cfd = perf_open(id, carrier_target());
    if (cfd < 0 && carrier_target() != getpid()) cfd = perf_open(id, getpid());
    if (cfd < 0) return made(Error::sys("perf_event_open the shared " + where()));
    auto c = attach_to_perf_event(prog, cfd, cookie, with_cookie);
    if (!c) return made(Error::sys("attach BPF program to the shared " + where(), c.error().err));
    ev.name = name;
    ev.id = id;
    ev.carrier = *c;
  }
  auto fail = [&](int err) { return Error::sys("perf_event_open " + where() + " for pid " + std::to_string(pid), err); };
  if (ev.refused) return fail(ev.refused);
  int fd = perf_open(ev.id, pid);
  if (fd < 0) {
    int err = errno;
    // The kernel checks the instruction at the first breakpoint it
    // places: an offset refused once is refused for every process.
    if (err == EINVAL || err == 524 /* ENOTSUPP */ || err == EOPNOTSUPP) ev.refused = err;
    return fail(err);
  }
  return Link{-1, fd};
}

std::vector<Link> take_carriers() {
  std::lock_guard<std::mutex> lk(g_mu);
  std::vector<Link> out;
  for (auto& [key, ev] : g_events)
    if (ev.carrier.perf_fd >= 0) {
      out.push_back(ev.carrier);
      ev.carrier = {};
    }
  return out;
}

std::vector<std::string> removal_lines() {
  std::lock_guard<std::mutex> lk(g_mu);
  std::vector<std::string> out;
  for (const auto& [key, ev] : g_events)
    if (ev.id >= 0) out.push_back("-:" + group_of(getpid()) + "/" + ev.name + "\n");
  return out;
}

void remove_events(const std::vector<std::string>& lines) {
  if (lines.empty() || events_file().empty()) return;
  int fd = open(events_file().c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return;
  for (const std::string& l : lines) (void)write_line(fd, l);
  close(fd);
}

void remove_group(pid_t owner) {
  if (events_file().empty()) return;
  const std::string g = group_of(owner);
  for (int pass = 0; pass < 5; pass++) {
    std::vector<std::pair<std::string, std::string>> mine;
    for (const auto& ge : listed())
      if (ge.first == g) mine.push_back(ge);
    if (mine.empty()) return;
    if (pass) usleep(50000);  // a close still under way
    remove_listed(mine);
  }
}

}  // namespace memtrace::loader::shared_uprobes
