// memtrace-debuginfod KIND BUILD-ID: one libdebuginfod query, for the
// symbolizer (src/symbolize/debuginfod.cpp), which runs it as a child process.
//
// Why a separate, dynamically linked program: memtrace-bpf is static, and
// libdebuginfod (dlopen'ed; Debian ships no .a) calls libcurl, which starts a
// resolver thread for every host name: pthread_create from a second, dlopen'ed
// glibc inside a static program crashes. Here libdebuginfod runs in an
// ordinary dynamic process; the parent bounds its wait by killing it.
//
// KIND: debuginfo | executable. BUILD-ID: lowercase hex. Environment:
// libdebuginfod's (DEBUGINFOD_URLS, DEBUGINFOD_CACHE_PATH, ...).
// Output on stdout, one line each:
//   progress A B      libdebuginfod's progress callback (at most 10 a second)
//   ok PATH           the file, in libdebuginfod's cache
//   error ERRNO       the query failed (ENOENT: no server has it)
//   nolib MESSAGE     libdebuginfod.so.1 could not be loaded
// Exit status 0 with "ok", else 1; 2 for bad arguments.
#include <dlfcn.h>
#include <elfutils/debuginfod.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

std::chrono::steady_clock::time_point g_last;

int on_progress(debuginfod_client*, long a, long b) {
  auto now = std::chrono::steady_clock::now();
  if (now - g_last >= std::chrono::milliseconds(100)) {
    g_last = now;
    std::printf("progress %ld %ld\n", a, b);
    std::fflush(stdout);
  }
  return 0;  // the parent decides when to give up (it kills this process)
}

}  // namespace

int main(int argc, char** argv) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the tool
  if (::getppid() == 1) return 1;
  if (argc != 3 || (std::strcmp(argv[1], "debuginfo") != 0 && std::strcmp(argv[1], "executable") != 0)) {
    std::fprintf(stderr, "usage: %s debuginfo|executable BUILD-ID\n", argv[0]);
    return 2;
  }
  void* h = ::dlopen("libdebuginfod.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    std::printf("nolib %s\n", e ? e : "libdebuginfod.so.1: cannot be loaded");
    return 1;
  }
  auto begin = reinterpret_cast<decltype(&debuginfod_begin)>(::dlsym(h, "debuginfod_begin"));
  auto set_progressfn = reinterpret_cast<decltype(&debuginfod_set_progressfn)>(::dlsym(h, "debuginfod_set_progressfn"));
  auto find = reinterpret_cast<decltype(&debuginfod_find_debuginfo)>(
      ::dlsym(h, std::strcmp(argv[1], "executable") == 0 ? "debuginfod_find_executable" : "debuginfod_find_debuginfo"));
  if (!begin || !set_progressfn || !find) {
    std::printf("nolib libdebuginfod.so.1 lacks the debuginfod_* functions\n");
    return 1;
  }
  debuginfod_client* c = begin();
  if (!c) {
    std::printf("error %d\n", ENOMEM);
    return 1;
  }
  set_progressfn(c, on_progress);
  g_last = std::chrono::steady_clock::now();
  char* path = nullptr;
  int fd = find(c, reinterpret_cast<const unsigned char*>(argv[2]), 0, &path);
  if (fd < 0) {
    std::printf("error %d\n", -fd);
    return 1;
  }
  std::printf("ok %s\n", path ? path : "");
  std::free(path);
  return 0;
}
