#include "symbolize/debuginfod.h"
#include "common/self_path.h"

#include <elfutils/debuginfod.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/hex.h"

extern char** environ;

namespace memtrace::symbolize {
namespace {

using Clock = std::chrono::steady_clock;
// Without DEBUGINFOD_TIMEOUT (libdebuginfod's default is 90 s): a server that
// extracts from a package archive may take seconds before its first byte.
constexpr int kDefaultStallS = 15;

std::string urls() {
  const char* u = std::getenv(DEBUGINFOD_URLS_ENV_VAR);
  return u ? u : "";
}

std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", s);
  return b;
}

std::mutex g_mu;  // one query at a time

}  // namespace

Debuginfod& Debuginfod::get() {
  static Debuginfod d;
  return d;
}

Debuginfod::Debuginfod() {
  s_.log = [](const std::string& m) { std::fprintf(stderr, "memtrace-bpf: %s\n", m.c_str()); };
}

void Debuginfod::configure(DebuginfodSettings s) {
  if (!s.log) s.log = s_.log;
  s_ = std::move(s);
  failed_ = false;
}

bool Debuginfod::active() const { return s_.enabled && !failed_ && !urls().empty(); }

void Debuginfod::warn(const std::string& msg) { s_.log(msg); }

std::string Debuginfod::helper_path() const {
  if (!s_.helper.empty()) return s_.helper;
  if (std::string p = self_dir() + "memtrace-debuginfod"; ::access(p.c_str(), X_OK) == 0) return p;
#ifdef MEMTRACE_DEBUGINFOD_BUILD_PATH
  if (::access(MEMTRACE_DEBUGINFOD_BUILD_PATH, X_OK) == 0) return MEMTRACE_DEBUGINFOD_BUILD_PATH;
#endif
  return "memtrace-debuginfod (next to this program)";
}

Debuginfod::Found Debuginfod::find(const std::string& build_id, const char* kind, const std::string& what) {
  Found res;
  if (build_id.empty() || !active()) return res;
  std::lock_guard<std::mutex> lk(g_mu);
  std::string helper = helper_path();
  if (::access(helper.c_str(), X_OK) != 0) {
    warn("DEBUGINFOD_URLS is set, but " + helper + " is missing: no debug files are downloaded");
    failed_ = true;
    return res;
  }
  ++stats_.queries;
  const std::string k = std::strcmp(kind, "executable") == 0 ? "executable" : "debuginfo";
  const std::string noun = k == "executable" ? "executable" : "debug file";
  const std::string about = noun + " of " + what + ", build-id " + hex_bytes(build_id);
  int stall_s = s_.stall_timeout_s;
  if (stall_s <= 0) {
    const char* t = std::getenv(DEBUGINFOD_TIMEOUT_ENV_VAR);
    stall_s = t && std::atoi(t) > 0 ? std::atoi(t) : kDefaultStallS;
  }

  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return res;
  Fd rd(p[0]), wr(p[1]);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, wr.get(), 1);
  std::string id = hex_bytes(build_id);
  char* argv[] = {helper.data(), const_cast<char*>(k.c_str()), id.data(), nullptr};
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, helper.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  wr.reset();
  if (rc != 0) {
    warn("debuginfod: cannot run " + helper + ": " + std::strerror(rc) + ": no debug files are downloaded");
    failed_ = true;
    return res;
  }

  // Its progress lines, until its answer or until it stalls.
  auto start = Clock::now(), last_progress = start;
  long last_bytes = -1;
  bool announced = false, stalled = false;
  std::string buf, answer;
  for (;;) {
    pollfd pf{rd.get(), POLLIN, 0};
    int n = ::poll(&pf, 1, 200);
    if (n < 0 && errno != EINTR) break;
    bool eof = false;
    if (n > 0) {
      char b[4096];
      ssize_t r = ::read(rd.get(), b, sizeof b);
      if (r <= 0) eof = true;
      else buf.append(b, static_cast<size_t>(r));
    }
    auto now = Clock::now();
    for (size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) {
      std::string line = buf.substr(0, nl);
      long a = 0, sz = 0;
      if (std::sscanf(line.c_str(), "progress %ld %ld", &a, &sz) == 2) {
        // Until the server answers (sz, the size, known), a is a counter,
        // not bytes: only data after the answer is progress.
        if (sz > 0 && a != last_bytes) {
          last_bytes = a;
          last_progress = now;
        }
        if (!announced && std::chrono::duration<double>(now - start).count() >= s_.progress_after_s) {
          announced = true;
          std::string m = "debuginfod: fetching the " + about;
          if (sz > 0) m += ", " + std::to_string((sz + (1 << 20) - 1) >> 20) + " MiB";
          warn(m + ", from " + urls() + " ...");
        }
      } else {
        answer = line;
      }
    }
    if (eof) break;
    if (std::chrono::duration<double>(now - last_progress).count() >= stall_s) {
      stalled = true;
      ::kill(pid, SIGKILL);
      break;
    }
  }
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  double took = std::chrono::duration<double>(Clock::now() - start).count();

  if (!stalled && answer.rfind("ok ", 0) == 0) {
    std::string path = answer.substr(3);
    res.fd = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (res.fd.valid()) {
      ++stats_.found;
      res.path = path;
      return res;
    }
  }
  int err = 0;
  if (!stalled && std::sscanf(answer.c_str(), "error %d", &err) == 1 && err == ENOENT) {
    ++stats_.not_found;  // no server has it: normal
    return res;
  }
  ++stats_.failed;
  failed_ = true;
  std::string why;
  if (stalled)
    why = std::string(last_bytes < 0 ? "no answer" : "no data") + " for " + std::to_string(stall_s) +
          " s (DEBUGINFOD_TIMEOUT)";
  else if (err > 0)
    why = std::string(std::strerror(err)) + " after " + seconds(took);
  else if (answer.rfind("nolib ", 0) == 0) {
    warn("DEBUGINFOD_URLS is set, but libdebuginfod cannot be loaded (" + answer.substr(6) +
         "): no debug files are downloaded (Debian: apt install libdebuginfod1)");
    return res;
  } else if (answer.rfind("ok ", 0) == 0)
    why = "cannot open " + answer.substr(3) + ": " + std::strerror(errno);
  else
    why = helper + (WIFSIGNALED(st) ? " died of signal " + std::to_string(WTERMSIG(st))
                                    : " exited with status " + std::to_string(WEXITSTATUS(st)));
  warn("debuginfod: " + urls() + ": " + why + ", asking for the " + about + ": no more downloads in this run");
  return res;
}

}  // namespace memtrace::symbolize
