#include "loader/guardian.h"

#include <bpf/bpf.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace memtrace::loader {
namespace {

constexpr int kSock = 3;  // the guardian's only descriptors: the socket, then the two maps

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

[[noreturn]] void guard() {
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
  close_range(kSock + 1, ~0U, 0);

  // The maps, or the loader's end of the socket closing first.
  int fds[2] = {-1, -1};
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

  while ((n = read(kSock, &byte, 1)) > 0 || (n < 0 && errno == EINTR)) {
  }
  // The loader is gone.
  uint32_t zero = 0, one = 1;
  bpf_map_update_elem(fds[1], &zero, &one, BPF_ANY);
  for (int us : {0, 20000, 200000}) {
    usleep(us);
    resume_all(fds[0]);
  }
  _exit(0);
}

}  // namespace

Result<Guardian> Guardian::start() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return Error::sys("guardian socketpair");
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
    guard();
  }
  close(sv[1]);
  Guardian g;
  g.pid_ = pid;
  g.sock_ = Fd(sv[0]);
  return g;
}

Result<void> Guardian::arm(int stopped_map_fd, int loader_gone_map_fd) {
  int fds[2] = {stopped_map_fd, loader_gone_map_fd};
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

}  // namespace memtrace::loader
