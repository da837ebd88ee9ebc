// memtrace_track C API: runs memtrace-singlestep on the calling process.
#include "memtrace_track.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

std::string helper_path() {
  if (const char* e = getenv("MEMTRACE_SINGLESTEP"); e && *e) return e;
#ifdef MEMTRACE_SINGLESTEP_BUILD_PATH
  if (access(MEMTRACE_SINGLESTEP_BUILD_PATH, X_OK) == 0) return MEMTRACE_SINGLESTEP_BUILD_PATH;
#endif
#ifdef MEMTRACE_SINGLESTEP_INSTALL_PATH
  if (access(MEMTRACE_SINGLESTEP_INSTALL_PATH, X_OK) == 0) return MEMTRACE_SINGLESTEP_INSTALL_PATH;
#endif
  return "memtrace-singlestep";
}

int wait_child(pid_t p) {
  int st = 0;
  while (waitpid(p, &st, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace

extern "C" MemTracker* StartTrackMemory(void* addr, size_t len, size_t max_num, int fd) {
  auto* t = static_cast<MemTracker*>(calloc(1, sizeof(MemTracker)));
  if (!t) return nullptr;
  t->addr = addr;
  t->len = len;
  t->max_num = max_num;
  t->fd = fd;
  snprintf(t->report_path, sizeof t->report_path, "/tmp/memtrace-track-XXXXXX");
  int rfd = mkstemp(t->report_path);
  if (rfd < 0) {
    free(t);
    return nullptr;
  }
  close(rfd);
  int ready[2];
  if (pipe(ready) != 0) {
    unlink(t->report_path);
    free(t);
    return nullptr;
  }
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  std::string helper = helper_path();
  std::string pid = std::to_string(getpid());
  char a[32], l[32], m[32];
  snprintf(a, sizeof a, "0x%llx", (unsigned long long)(uintptr_t)addr);
  snprintf(l, sizeof l, "%zu", len);
  snprintf(m, sizeof m, "%zu", max_num);
  std::vector<std::string> args{helper, "-p", pid, "--addr", a, "--len", l, "--format", "json", "-o",
                                t->report_path, "--ready-fd", "3"};
  if (max_num) args.insert(args.end(), {"--max", m});
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t child = fork();
  if (child == 0) {
    int w = fcntl(ready[1], F_DUPFD, 10);  // out of the way of fd 3
    close(ready[0]);
    close(ready[1]);
    dup2(w, 3);
    close(w);
    setpgid(0, 0);  // the program's Ctrl-C is not the helper's
    execvp(argv[0], argv.data());
    fprintf(stderr, "StartTrackMemory: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  close(ready[1]);
  if (child < 0) {
    close(ready[0]);
    unlink(t->report_path);
    free(t);
    return nullptr;
  }
  t->helper_pid = child;
  char c = 0;
  ssize_t n;
  do n = read(ready[0], &c, 1);
  while (n < 0 && errno == EINTR);
  close(ready[0]);
  if (n != 1) {  // the helper failed before arming; it said why on stderr
    wait_child(child);
    unlink(t->report_path);
    free(t);
    errno = ECHILD;
    return nullptr;
  }
  return t;
}

extern "C" int EndTrackMemory(MemTracker* t) {
  if (!t || !t->helper_pid) return -1;
  kill(t->helper_pid, SIGTERM);
  int status = wait_child(t->helper_pid);
  t->helper_pid = 0;
  std::ifstream in(t->report_path);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  unlink(t->report_path);
  if (status != 0 || j.is_discarded()) return -1;
  const auto& acc = j["accesses"];
  t->num_access = acc.size();
  t->addrs = static_cast<void**>(calloc(t->num_access ? t->num_access : 1, sizeof(void*)));
  t->accesses = static_cast<MemTrackAccess*>(calloc(t->num_access ? t->num_access : 1, sizeof(MemTrackAccess)));
  size_t i = 0;
  for (const auto& a : acc) {
    MemTrackAccess& r = t->accesses[i];
    r.time_ns = a["time_ns"].get<uint64_t>();
    r.tid = a["tid"].get<pid_t>();
    r.ip = std::stoull(a["ip"].get<std::string>(), nullptr, 16);
    r.addr = std::stoull(a["address"].get<std::string>(), nullptr, 16);
    r.size = a["size"].get<uint32_t>();
    std::string k = a["access"];
    r.kind = k == "read" ? MEMTRACK_READ : k == "write" ? MEMTRACK_WRITE : MEMTRACK_READ_WRITE;
    t->addrs[i] = reinterpret_cast<void*>(static_cast<uintptr_t>(r.addr));
    if (t->fd >= 0)
      dprintf(t->fd, "%s 0x%llx %u %s tid %d ip 0x%llx %s\n", "access", (unsigned long long)r.addr, r.size,
              k.c_str(), r.tid, (unsigned long long)r.ip, a["function"].get<std::string>().c_str());
    i++;
  }
  if (t->fd >= 0) dprintf(t->fd, "access %zu times\n", t->num_access);
  return 0;
}

extern "C" void FreeMemTracker(MemTracker* t) {
  if (!t) return;
  if (t->helper_pid) EndTrackMemory(t);
  free(t->addrs);
  free(t->accesses);
  free(t);
}
