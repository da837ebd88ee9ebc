#include "loader/guardian.h"

#include "loader/shared_uprobes.h"

#include <bpf/bpf.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace memtrace::loader {
namespace {

constexpr int kSock = 3;  // the guardian's descriptors: the socket, a pidfd of the loader, then the three maps
constexpr int kMaxFdsPerMessage = 250;  // SCM_MAX_FD is 253

// The links handed over, being closed: one thread per hand_over.
std::mutex g_mu;
std::condition_variable g_cv;
int g_closing = 0;

int g_hold_ms = 0;  // tests (MEMTRACE_TEST_GUARDIAN_HOLD_MS): each hand_over held this long first

void close_on_a_thread(std::vector<int> fds) {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_closing++;
  }
  auto body = [fds = std::move(fds)] {
    if (g_hold_ms > 0) usleep(g_hold_ms * 1000);
    for (int fd : fds) close(fd);  // the detach: an RCU grace period each
    std::lock_guard<std::mutex> lk(g_mu);
    g_closing--;
    g_cv.notify_all();
  };
  try {
    std::thread(std::move(body)).detach();
  } catch (...) {  // no thread: closed here, in turn
    body();
  }
}

// SIGCONT to every tgid in the map. Entries stay: a second pass costs a
// failed kill() at most, and an entry the BPF side added just before it saw
// loader_gone is caught by the later passes.
void resume_all(int stopped) {
  uint32_t key, next;
  uint32_t* prev = nullptr;
  for (int n = 0; n < 65536 && bpf_map_get_next_key(stopped, prev, &next) == 0; n++) {
    kill(static_cast<pid_t>(next), SIGCONT);
    key = next;
    prev = &key;
  }
}

// Is pid stopped (SIGSTOP: state T)? Read without allocating.
bool is_stopped(uint32_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%u/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  const char* rp = strrchr(buf, ')');
  return rp && rp[1] == ' ' && rp[2] == 'T';
}

// Every traced process (the targets map) found stopped: a stop whose record
// the loader had already deleted when its SIGSTOP landed (sent from the
// tracepoint through irq_work) is resumed too.
void resume_stopped_targets(int targets) {
  uint32_t key, next;
  uint32_t* prev = nullptr;
  for (int n = 0; n < 65536 && bpf_map_get_next_key(targets, prev, &next) == 0; n++) {
    if (is_stopped(next)) kill(static_cast<pid_t>(next), SIGCONT);
    key = next;
    prev = &key;
  }
}

[[noreturn]] void guard(pid_t loader) {
  // Readable once the loader has exited (every fd closed, its BPF programs
  // detached): after that nothing can stop a process any more.
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, loader, 0));
  if (const char* h = getenv("MEMTRACE_TEST_GUARDIAN_HOLD_MS")) g_hold_ms = atoi(h);
  setsid();  // not in the loader's terminal session: Ctrl-C and hangups are the loader's
  prctl(PR_SET_NAME, "memtrace-guard");
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU, SIGUSR1, SIGUSR2})
    signal(s, SIG_IGN);
  // The OOM killer should take the loader (which this undoes), not this.
  if (int f = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); f >= 0) {
    (void)!write(f, "-1000", 5);
    close(f);
  }
  int null = open("/dev/null", O_RDWR);
  for (int fd = 0; fd < 3; fd++) dup2(null, fd);
  if (pidfd >= 0 && pidfd != kSock + 1) {
    dup2(pidfd, kSock + 1);
    close(pidfd);
  }
  pidfd = pidfd >= 0 ? kSock + 1 : -1;
  close_range(kSock + 2, ~0U, 0);
  // The loader raises its own limit after this fork: links handed over
  // past this one's would be closed by recvmsg itself, slowly.
  struct rlimit nf;
  if (getrlimit(RLIMIT_NOFILE, &nf) == 0 && nf.rlim_cur < nf.rlim_max) {
    nf.rlim_cur = nf.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nf);
  }

  // The maps, or the loader's end of the socket closing first.
  int fds[3] = {-1, -1, -1};
  char byte;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof fds)];
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  ssize_t n;
  while ((n = recvmsg(kSock, &m, MSG_CMSG_CLOEXEC)) < 0 && errno == EINTR) {
  }
  cmsghdr* c = n > 0 ? CMSG_FIRSTHDR(&m) : nullptr;
  if (!c || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(sizeof fds)) _exit(0);
  memcpy(fds, CMSG_DATA(c), sizeof fds);

  // Until the loader's end closes: links it hands over (hand_over), each
  // message closed on a thread of its own.
  for (;;) {
    alignas(cmsghdr) char lctl[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
    msghdr lm{};
    iovec liov{&byte, 1};
    lm.msg_iov = &liov;
    lm.msg_iovlen = 1;
    lm.msg_control = lctl;
    lm.msg_controllen = sizeof lctl;
    n = recvmsg(kSock, &lm, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (cmsghdr* h = CMSG_FIRSTHDR(&lm); h; h = CMSG_NXTHDR(&lm, h)) {
      if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
      size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      std::vector<int> got(k);
      memcpy(got.data(), CMSG_DATA(h), k * sizeof(int));
      close_on_a_thread(std::move(got));
    }
  }
  // The loader is going: no stop from here on, and every process it
  // stopped resumed, again while its programs may still run (a stop they
  // decided on before loader_gone was set), and after it is gone.
  uint32_t zero = 0, one = 1;
  bpf_map_update_elem(fds[1], &zero, &one, BPF_ANY);
  resume_all(fds[0]);
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    for (int waited = 0; waited < 30000 && poll(&p, 1, 20) == 0; waited += 20) resume_all(fds[0]);
  }
  for (int us : {0, 20000, 100000, 200000}) {
    usleep(us);
    resume_all(fds[0]);
    resume_stopped_targets(fds[2]);
  }
  // The links still being closed: the programs may still run until the
  // last one is (no stop: loader_gone is set).
  {
    std::unique_lock<std::mutex> lk(g_mu);
    while (g_closing > 0) {
      g_cv.wait_for(lk, std::chrono::milliseconds(100));
      resume_all(fds[0]);
    }
  }
  resume_all(fds[0]);
  resume_stopped_targets(fds[2]);
  // Every link closed and the loader gone: the uprobe events it shared
  // between its processes are free to go (shared_uprobes.h).
  shared_uprobes::remove_group(loader);
  _exit(0);
}

}  // namespace

Result<Guardian> Guardian::start() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return Error::sys("guardian socketpair");
  pid_t loader = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    int e = errno;
    close(sv[0]);
    close(sv[1]);
    return Error::sys("fork the guardian process", e);
  }
  if (pid == 0) {
    close(sv[0]);
    if (sv[1] != kSock) {
      dup2(sv[1], kSock);  // clears CLOEXEC: not that anything is exec'd
      close(sv[1]);
    }
    guard(loader);
  }
  close(sv[1]);
  Guardian g;
  g.pid_ = pid;
  g.sock_ = Fd(sv[0]);
  return g;
}

Result<void> Guardian::arm(int stopped_map_fd, int loader_gone_map_fd, int targets_map_fd) {
  int fds[3] = {stopped_map_fd, loader_gone_map_fd, targets_map_fd};
  char byte = 1;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof fds)] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof fds);
  memcpy(CMSG_DATA(c), fds, sizeof fds);
  if (sendmsg(sock_.get(), &m, MSG_NOSIGNAL) != 1) return Error::sys("hand the BPF maps to the guardian process");
  return {};
}

Result<void> Guardian::hand_over(const std::vector<int>& fds) {
  for (size_t at = 0; at < fds.size(); at += kMaxFdsPerMessage) {
    size_t k = std::min<size_t>(kMaxFdsPerMessage, fds.size() - at);
    char byte = 2;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)] = {};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * k);
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * k);
    memcpy(CMSG_DATA(c), fds.data() + at, sizeof(int) * k);
    if (sendmsg(sock_.get(), &m, MSG_NOSIGNAL) != 1) return Error::sys("hand BPF links to the guardian process");
  }
  return {};
}

}  // namespace memtrace::loader
