#include "symbolize/debuginfod.h"

#include <dlfcn.h>
#include <elfutils/debuginfod.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "symbolize/elf_image.h"

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

std::string fd_path(int fd) {
  char buf[4096];
  ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// The query in flight (libdebuginfod's progress callback has no user pointer
// in every version; queries are serialized by Impl::mu).
struct Query {
  Clock::time_point start, last_progress;
  long last_bytes = -1;
  bool announced = false;
  bool stalled = false;
  std::string what, kind;
  double progress_after_s = 2;
  int stall_s = kDefaultStallS;
  const std::function<void(const std::string&)>* log = nullptr;
};
Query* g_query = nullptr;

int on_progress(debuginfod_client*, long a, long b) {
  Query* q = g_query;
  if (!q) return 0;
  auto now = Clock::now();
  // Until the server answers (b, the size, is known), libdebuginfod passes a
  // counter in a, not bytes: only data after the answer is progress.
  if (b > 0 && a != q->last_bytes) {
    q->last_bytes = a;
    q->last_progress = now;
  }
  double ran = std::chrono::duration<double>(now - q->start).count();
  if (!q->announced && ran >= q->progress_after_s) {
    q->announced = true;
    std::string m = "debuginfod: fetching the " + q->kind + " of " + q->what;
    if (b > 0) m += ", " + std::to_string((b + (1 << 20) - 1) >> 20) + " MiB";
    m += ", from " + urls() + " ...";
    (*q->log)(m);
  }
  if (std::chrono::duration<double>(now - q->last_progress).count() >= q->stall_s) {
    q->stalled = true;
    return 1;  // abandon: no answer, or no byte, for stall_s seconds
  }
  return 0;
}

}  // namespace

struct Debuginfod::Impl {
  void* dl = nullptr;
  decltype(&debuginfod_begin) begin = nullptr;
  decltype(&debuginfod_end) end = nullptr;
  decltype(&debuginfod_find_debuginfo) find_debuginfo = nullptr;
  decltype(&debuginfod_find_executable) find_executable = nullptr;
  decltype(&debuginfod_set_progressfn) set_progressfn = nullptr;
  debuginfod_client* client = nullptr;
  std::mutex mu;
};

Debuginfod& Debuginfod::get() {
  static Debuginfod d;
  return d;
}

Debuginfod::Debuginfod() {
  s_.log = [](const std::string& m) { std::fprintf(stderr, "memtrace-bpf: %s\n", m.c_str()); };
}

Debuginfod::~Debuginfod() {
  // The client and library stay until exit: libcurl's global state is not
  // ours to tear down from a static destructor.
}

void Debuginfod::configure(DebuginfodSettings s) {
  if (!s.log) s.log = s_.log;
  s_ = std::move(s);
  failed_ = false;
}

bool Debuginfod::active() const { return s_.enabled && !failed_ && !urls().empty(); }

void Debuginfod::warn(const std::string& msg) { s_.log(msg); }

bool Debuginfod::load() {
  if (load_tried_) return impl_ && impl_->client;
  load_tried_ = true;
  void* h = ::dlopen(s_.library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    warn("DEBUGINFOD_URLS is set, but " + s_.library + " cannot be loaded (" + (e ? e : "?") +
         "): no debug files are downloaded (Debian: apt install libdebuginfod1)");
    return false;
  }
  auto* im = new Impl();
  im->dl = h;
  im->begin = reinterpret_cast<decltype(im->begin)>(::dlsym(h, "debuginfod_begin"));
  im->end = reinterpret_cast<decltype(im->end)>(::dlsym(h, "debuginfod_end"));
  im->find_debuginfo = reinterpret_cast<decltype(im->find_debuginfo)>(::dlsym(h, "debuginfod_find_debuginfo"));
  im->find_executable = reinterpret_cast<decltype(im->find_executable)>(::dlsym(h, "debuginfod_find_executable"));
  im->set_progressfn = reinterpret_cast<decltype(im->set_progressfn)>(::dlsym(h, "debuginfod_set_progressfn"));
  if (!im->begin || !im->end || !im->find_debuginfo || !im->find_executable || !im->set_progressfn) {
    warn(s_.library + " lacks the debuginfod_* functions: no debug files are downloaded");
    delete im;
    return false;
  }
  im->client = im->begin();
  if (!im->client) {
    warn("debuginfod_begin failed: no debug files are downloaded");
    delete im;
    return false;
  }
  im->set_progressfn(im->client, on_progress);
  impl_ = im;
  return true;
}

Debuginfod::Found Debuginfod::find(const std::string& build_id, const char* kind, const std::string& what) {
  Found res;
  if (build_id.empty() || !active() || !load()) return res;
  std::lock_guard<std::mutex> lk(impl_->mu);
  ++stats_.queries;
  Query q;
  q.start = q.last_progress = Clock::now();
  q.what = what + ", build-id " + hex(build_id);
  q.kind = std::strcmp(kind, "executable") == 0 ? "executable" : "debug file";
  q.progress_after_s = s_.progress_after_s;
  q.stall_s = s_.stall_timeout_s;
  if (q.stall_s <= 0) {
    const char* t = std::getenv(DEBUGINFOD_TIMEOUT_ENV_VAR);
    q.stall_s = t && std::atoi(t) > 0 ? std::atoi(t) : kDefaultStallS;
  }
  q.log = &s_.log;
  g_query = &q;
  const auto* id = reinterpret_cast<const unsigned char*>(build_id.data());
  int n = static_cast<int>(build_id.size());
  // path = nullptr: the string would be malloc'ed by the library's libc.
  int fd = std::strcmp(kind, "executable") == 0 ? impl_->find_executable(impl_->client, id, n, nullptr)
                                                : impl_->find_debuginfo(impl_->client, id, n, nullptr);
  g_query = nullptr;
  double took = std::chrono::duration<double>(Clock::now() - q.start).count();
  if (fd >= 0) {
    ++stats_.found;
    res.fd = Fd(fd);
    res.path = fd_path(fd);
    return res;
  }
  if (fd == -ENOENT && !q.stalled) {  // no server has it: normal (an abandoned query reports ENOENT too)
    ++stats_.not_found;
    return res;
  }
  ++stats_.failed;
  failed_ = true;
  char b[64];
  std::snprintf(b, sizeof b, " after %.1f s", took);
  std::string why = q.stalled ? (q.last_bytes < 0 ? "no answer" : "no data") + std::string(" for ") +
                                    std::to_string(q.stall_s) + " s (DEBUGINFOD_TIMEOUT)"
                              : std::strerror(-fd) + std::string(b);
  warn("debuginfod: " + urls() + ": " + why + ", asking for the " + q.kind + " of " + q.what +
       ": no more downloads in this run");
  return res;
}

}  // namespace memtrace::symbolize
