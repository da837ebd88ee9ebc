#include "loader/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace memtrace::loader {

namespace {

// prog is a file that exec can run: a regular file with execute permission
// for this process (access(2) as root: any execute bit).
int exec_errno(const std::string& prog) {
  struct stat st;
  if (stat(prog.c_str(), &st) != 0) return errno;
  if (!S_ISREG(st.st_mode)) return EACCES;  // what execve says of a directory
  if (access(prog.c_str(), X_OK) != 0) return errno;
  return 0;
}

}  // namespace

Result<void> Launcher::check_executable(const std::string& prog) {
  auto fail = [&](int e) { return Error{"cannot execute " + prog + ": " + strerror(e), e}; };
  if (prog.empty()) return fail(ENOENT);
  if (prog.find('/') != std::string::npos) {
    if (int e = exec_errno(prog)) return fail(e);
    return {};
  }
  // As execvp: each PATH entry in turn (its default when PATH is unset);
  // EACCES from one is kept if no other entry has the program.
  const char* path = getenv("PATH");
  std::string dirs = path ? path : "/bin:/usr/bin";
  int err = ENOENT;
  for (size_t at = 0; at <= dirs.size();) {
    size_t end = dirs.find(':', at);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(at, end - at);
    at = end + 1;
    int e = exec_errno((dir.empty() ? "." : dir) + "/" + prog);
    if (e == 0) return {};
    if (e == EACCES) err = EACCES;
  }
  return Error{"cannot execute " + prog + ": " + (err == ENOENT ? "not found in PATH" : strerror(err)), err};
}

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
    exec_failed_ = true;
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
