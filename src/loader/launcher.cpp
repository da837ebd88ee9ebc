#include "loader/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace memtrace::loader {

Result<Launcher> Launcher::start(const std::vector<std::string>& argv) {
  if (argv.empty()) return Error::msg("no program to launch");
  int go[2], err[2];
  if (pipe2(go, O_CLOEXEC) != 0) return Error::sys("pipe");
  if (pipe2(err, O_CLOEXEC) != 0) return Error::sys("pipe");
  pid_t pid = fork();
  if (pid < 0) return Error::sys("fork");
  if (pid == 0) {
    close(go[1]);
    close(err[0]);
    char c;
    // Wait for the tracer; if it dies first, read() returns 0 and we do not run.
    if (read(go[0], &c, 1) != 1) _exit(127);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    // The tool ignores nothing the program would not: restore default signal handling.
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGHUP, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execvp(args[0], args.data());
    int e = errno;
    (void)!write(err[1], &e, sizeof e);
    _exit(127);
  }
  close(go[0]);
  close(err[1]);
  Launcher l;
  l.pid_ = pid;
  l.go_ = Fd(go[1]);
  l.err_ = Fd(err[0]);
  l.prog_ = argv[0];
  return l;
}

Launcher::~Launcher() {
  // Never leave a held child behind: closing go_ makes it exit (127).
}

Result<void> Launcher::release() {
  char c = 1;
  if (write(go_.get(), &c, 1) != 1) return Error::sys("release " + prog_);
  go_.reset();
  int e = 0;
  ssize_t n = read(err_.get(), &e, sizeof e);
  err_.reset();
  if (n == sizeof e) {
    int st;
    waitpid(pid_, &st, 0);
    reaped_ = true;
    return Error{"cannot execute " + prog_ + ": " + strerror(e), e};
  }
  return {};
}

bool Launcher::poll_exit(int* status) {
  if (reaped_) return true;
  int st;
  pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    *status = st;
    return true;
  }
  return false;
}

int Launcher::exit_code_of(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return 1;
}

}  // namespace memtrace::loader
