// A stripped program traced and replayed by the real tool, its debug file
// found by build-id through --symbols DIR or a debuginfod server (a real
// `debuginfod` started here on a free port, or a server that is down, or one
// that is slow): its frames must get function and file:line, or say where they
// are (`??`, module and file offset) when no debug file is to be had.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <atomic>
#include <cstring>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "harness.h"
#include "test_env.h"
#include "shell.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace memtrace::testing;
using Clock = std::chrono::steady_clock;

namespace {

const std::string kBin = target("stripped_target");
const std::string kDebugDir = std::string(DI_DIR) + "/debug";

std::string tmpdir() {
  char t[] = "/tmp/memtrace-di.XXXXXX";
  return ::mkdtemp(t);
}


std::string build_id(const std::string& file) {
  std::string id = memtrace::testing::shell_output("readelf -n '" + file + "' | awk '/Build ID/ {print $3}'");
  while (!id.empty() && id.back() == '\n') id.pop_back();
  return id;
}

int line_of(const std::string& mark) {
  std::ifstream in(TARGET_SOURCE);
  int n = 0;
  for (std::string l; std::getline(in, l);) {
    ++n;
    if (l.find(mark) != std::string::npos) return n;
  }
  return -1;
}

// Environment of the tool runs: set here, restored at the end of the test.
class Env {
 public:
  void set(const std::string& k, const std::string& v) {
    save(k);
    ::setenv(k.c_str(), v.c_str(), 1);
  }
  void unset(const std::string& k) {
    save(k);
    ::unsetenv(k.c_str());
  }
  ~Env() {
    for (auto& [k, v] : saved_)
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
  }

 private:
  void save(const std::string& k) {
    if (saved_.count(k)) return;
    const char* v = ::getenv(k.c_str());
    saved_[k] = v ? std::optional<std::string>(v) : std::nullopt;
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

// A TCP socket on 127.0.0.1, port chosen by the kernel.
int bound_socket(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

// A real debuginfod (elfutils) serving the ELF/DWARF files under dir.
class DebuginfodServer {
 public:
  // Empty on success, else why not.
  std::string start(const std::string& dir, const std::string& work) {
    if (memtrace::testing::shell_output("command -v debuginfod").empty()) return "debuginfod is not installed (scripts/deps.txt)";
    std::string id = build_id(kBin);
    for (int attempt = 0; attempt < 3; ++attempt) {
      int fd = bound_socket(&port_);
      if (fd < 0) return "no free port";
      ::close(fd);  // debuginfod binds it (a race with another binder: retried)
      std::string db = work + "/db" + std::to_string(attempt) + ".sqlite";
      pid_ = ::fork();
      if (pid_ == 0) {
        int log = ::open((work + "/debuginfod.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
        ::dup2(log, 1);
        ::dup2(log, 2);
        std::string p = std::to_string(port_);
        ::execlp("debuginfod", "debuginfod", "-F", "-p", p.c_str(), "-d", db.c_str(), "-t", "0", "-g", "0",
                 dir.c_str(), nullptr);
        _exit(127);
      }
      // Ready when it serves the program's debug file. The probe has its own
      // cache, new each time: libdebuginfod caches a 404 (before the scan) for
      // 10 minutes.
      std::string probe = "rm -rf " + work + "/probe-cache; DEBUGINFOD_URLS=" + url() + " DEBUGINFOD_CACHE_PATH=" +
                          work + "/probe-cache debuginfod-find debuginfo " + id + " >/dev/null 2>&1";
      for (int i = 0; i < 100; ++i) {
        if (::waitpid(pid_, nullptr, WNOHANG) == pid_) break;
        if (std::system(probe.c_str()) == 0) return "";
        ::usleep(100000);
      }
      stop();
    }
    return "debuginfod did not serve " + id + ": " + memtrace::testing::shell_output("tail -5 '" + work + "/debuginfod.log'");
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }
  ~DebuginfodServer() { stop(); }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

// Frames of the target's own code in its leak stacks.
std::vector<json> own_frames(const json& rep, const std::string& bin = kBin) {
  std::vector<json> out;
  if (!rep.is_object()) return out;
  for (const auto& p : rep["processes"])
    for (const auto& g : p.value("leaks", json::array()))
      for (const auto& f : g["stack"])
        if (f.value("module", "") == bin) out.push_back(f);
  return out;
}

// make_name and keep_names named, at the lines of the source's marks.
void expect_symbolized(const json& rep, const std::string& bin = kBin) {
  auto fs = own_frames(rep, bin);
  ASSERT_FALSE(fs.empty()) << rep.dump().substr(0, 2000);
  std::map<std::string, json> by;
  for (const auto& f : fs) by.emplace(f.value("function", ""), f);
  ASSERT_TRUE(by.count("make_name") && by.count("keep_names") && by.count("main")) << json(fs).dump();
  EXPECT_EQ(by["make_name"].value("line", 0), line_of("MARK-LEAK"));
  EXPECT_EQ(by["keep_names"].value("line", 0), line_of("MARK-CALL"));
  EXPECT_TRUE(by["make_name"].value("file", "").ends_with("stripped_target.c")) << by["make_name"];
  for (const auto& f : fs) EXPECT_FALSE(f.contains("unknown")) << f;
}

// Every own frame ?? with its file offset (nothing names a stripped program's
// static functions).
void expect_unknown(const json& rep, const std::string& bin = kBin, const std::string& reason = "no symbols") {
  auto fs = own_frames(rep, bin);
  ASSERT_GE(fs.size(), 3u) << rep.dump().substr(0, 2000);  // make_name, keep_names, main
  for (const auto& f : fs) {
    EXPECT_EQ(f.value("function", "?"), "") << f;
    EXPECT_EQ(f.value("unknown", ""), reason) << f;
    EXPECT_TRUE(f.value("module_offset", "").starts_with("0x")) << f;
  }
}

size_t count_lines(const std::string& s, const std::string& needle) {
  size_t n = 0;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) n += l.find(needle) != std::string::npos;
  return n;
}

ToolRun launch(std::vector<std::string> extra = {}, const std::string& bin = kBin) {
  extra.push_back("--");
  extra.push_back(bin);
  return run_tool(extra);
}

// `memtrace-bpf replay FILE --format json ARGS`.
ToolRun replay(const std::string& file, std::vector<std::string> args = {}) {
  std::vector<std::string> argv = {tool(), "replay", file, "--format", "json"};
  argv.insert(argv.end(), args.begin(), args.end());
  ToolRun r = run_argv(argv);
  r.report = json::parse(r.out, nullptr, false);
  return r;
}

void require_setup() {
  if (geteuid() != 0) MEMTRACE_SKIP_OR_FAIL("needs root (BPF, uprobes)");
  ASSERT_EQ(memtrace::testing::shell_output("readelf -S '" + kBin + "' | grep -c -E '\\.symtab|\\.debug_info|gnu_debuglink'"), "0\n")
      << "the target must be stripped";
}

}  // namespace

// The stripped program's frames: ?? (module+offset) without a debug file;
// function and file:line with DEBUGINFOD_URLS naming a real debuginfod that
// has it; the download cached (a second run needs no server); --no-debuginfod
// asks nothing.
TEST(Debuginfod, StrippedProgramFramesGetNamesAndLines) {
  require_setup();
  std::string work = tmpdir();
  Env env;
  env.unset("DEBUGINFOD_URLS");
  env.set("DEBUGINFOD_CACHE_PATH", work + "/cache");
  auto none = launch();
  ASSERT_EQ(none.code, 0) << none.err;
  expect_unknown(none.report);

  DebuginfodServer srv;
  std::string why = srv.start(kDebugDir, work);
  if (!why.empty()) MEMTRACE_SKIP_OR_FAIL(why);
  env.set("DEBUGINFOD_URLS", srv.url());
  auto got = launch();
  ASSERT_EQ(got.code, 0) << got.err;
  expect_symbolized(got.report);
  EXPECT_EQ(count_lines(got.err, "debuginfod"), 0u) << got.err;
  std::string cached = work + "/cache/" + build_id(kBin) + "/debuginfo";
  EXPECT_TRUE(fs::exists(cached)) << "DEBUGINFOD_CACHE_PATH respected";

  srv.stop();  // from the cache now
  auto again = launch();
  expect_symbolized(again.report);
  EXPECT_EQ(count_lines(again.err, "debuginfod"), 0u) << again.err;

  env.set("DEBUGINFOD_CACHE_PATH", work + "/empty-cache");
  auto off = launch({"--no-debuginfod"});
  expect_unknown(off.report);
  EXPECT_FALSE(fs::exists(work + "/empty-cache/" + build_id(kBin))) << "--no-debuginfod asked anyway";
  fs::remove_all(work);
}

// Live outputs (--trace here; --interval and the console alike) never wait
// for a download on the drain thread: they symbolize from local files, and
// debuginfod is asked once, for the final report.
TEST(Debuginfod, LiveOutputsUseLocalFilesTheFinalReportAsks) {
  require_setup();
  std::string work = tmpdir();
  Env env;
  env.set("DEBUGINFOD_CACHE_PATH", work + "/cache");
  DebuginfodServer srv;
  std::string why = srv.start(kDebugDir, work);
  if (!why.empty()) MEMTRACE_SKIP_OR_FAIL(why);
  env.set("DEBUGINFOD_URLS", srv.url());
  std::string trace = work + "/trace.txt", rep = work + "/r.json";
  auto r = run_argv({tool(), "--trace", "-o", trace, "-o", rep, "--", kBin});
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream tin(trace);
  size_t own = 0;
  for (std::string l; std::getline(tin, l);) {
    if (l.find(" malloc ") == std::string::npos || l.find(" in " + kBin) == std::string::npos) continue;
    ++own;  // a malloc called from the program itself: make_name, 16 times
    EXPECT_NE(l.find("?? ("), std::string::npos) << l;
    EXPECT_EQ(l.find("make_name"), std::string::npos) << "asked debuginfod while tracing: " << l;
  }
  EXPECT_EQ(own, 16u);
  std::ifstream jin(rep);
  expect_symbolized(json::parse(jin, nullptr, false));
  fs::remove_all(work);
}

// A server that is down: one warning, no wait; one that accepts and never
// answers: one warning after DEBUGINFOD_TIMEOUT. Frames stay ?? (module+offset).
TEST(Debuginfod, ServerDownCostsOneWarningAndABoundedWait) {
  require_setup();
  std::string work = tmpdir();
  Env env;
  env.set("DEBUGINFOD_CACHE_PATH", work + "/cache");
  int port = 0;
  int closed = bound_socket(&port);  // bound, never listening: connections are refused
  ASSERT_GE(closed, 0);
  // By host name when /etc/hosts has this machine's as 127.x (libcurl then
  // resolves in a thread of its own: what crashed a static program that had
  // dlopen'ed libdebuginfod), else by address.
  char host[256] = "127.0.0.1";
  ::gethostname(host, sizeof host);
  if (memtrace::testing::shell_output(std::string("getent ahostsv4 ") + host + " | head -1").rfind("127.", 0) != 0) std::strcpy(host, "127.0.0.1");
  env.set("DEBUGINFOD_URLS", std::string("http://") + host + ":" + std::to_string(port));
  auto t0 = Clock::now();
  auto down = launch();
  double s_down = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_EQ(down.code, 0) << down.err;
  expect_unknown(down.report);
  EXPECT_EQ(count_lines(down.err, "debuginfod"), 1u) << down.err;
  EXPECT_EQ(count_lines(down.err, "Connection refused"), 1u) << down.err;
  ::close(closed);

  int port2 = 0;
  int mute = bound_socket(&port2);
  ASSERT_EQ(::listen(mute, 16), 0);  // the kernel completes connections; nobody answers
  env.set("DEBUGINFOD_URLS", "http://127.0.0.1:" + std::to_string(port2));
  env.set("DEBUGINFOD_TIMEOUT", "3");
  t0 = Clock::now();
  auto hang = launch();
  double s_hang = std::chrono::duration<double>(Clock::now() - t0).count();
  ::close(mute);
  ASSERT_EQ(hang.code, 0) << hang.err;
  expect_unknown(hang.report);
  EXPECT_EQ(count_lines(hang.err, "no more downloads"), 1u) << hang.err;
  EXPECT_EQ(count_lines(hang.err, "no answer for 3 s"), 1u) << hang.err;
  // One bounded wait for the whole run (3 s), not one per module.
  EXPECT_LT(s_hang, s_down + 3 + 8) << "down: " << s_down << " s, mute: " << s_hang << " s";
  std::printf("[ timing   ] refused: %.1f s, mute server with DEBUGINFOD_TIMEOUT=3: %.1f s\n", s_down, s_hang);
  fs::remove_all(work);
}

// A download that takes a while (a server sending the debug file over ~4 s)
// prints one progress line, and the frames get their names.
TEST(Debuginfod, SlowDownloadPrintsOneProgressLine) {
  require_setup();
  std::string work = tmpdir();
  std::ifstream in(kDebugDir + "/stripped_target.debug", std::ios::binary);
  std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(body.size(), 1000u);
  int port = 0;
  int lfd = bound_socket(&port);
  ASSERT_EQ(::listen(lfd, 16), 0);
  std::string want = "/buildid/" + build_id(kBin) + "/debuginfo";
  std::atomic<int> served{0};
  std::thread server([&] {
    for (;;) {
      int c = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;  // listening socket shut down
      std::string req;
      char b[4096];
      ssize_t n;
      while (req.find("\r\n\r\n") == std::string::npos && (n = ::read(c, b, sizeof b)) > 0) req.append(b, n);
      if (req.find(want) == std::string::npos) {
        std::string r = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        (void)!::write(c, r.data(), r.size());
      } else {
        std::string h = "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: " +
                        std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n";
        (void)!::write(c, h.data(), h.size());
        const size_t parts = 8;
        for (size_t i = 0; i < parts; ++i) {
          size_t a = body.size() * i / parts, z = body.size() * (i + 1) / parts;
          (void)!::write(c, body.data() + a, z - a);
          ::usleep(500000);
        }
        ++served;
      }
      ::close(c);
    }
  });
  Env env;
  env.set("DEBUGINFOD_CACHE_PATH", work + "/cache");
  env.set("DEBUGINFOD_URLS", "http://127.0.0.1:" + std::to_string(port));
  auto r = launch();
  ::shutdown(lfd, SHUT_RDWR);
  ::close(lfd);
  server.join();
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(served.load(), 1);
  expect_symbolized(r.report);
  EXPECT_EQ(count_lines(r.err, "debuginfod: fetching the debug file of " + kBin), 1u) << r.err;
  EXPECT_EQ(count_lines(r.err, "debuginfod"), 1u) << r.err;
  fs::remove_all(work);
}

// A recording made without any debug file is symbolized completely by
// `replay --symbols DIR` holding the .debug file; without it, ?? with offsets.
TEST(Replay, StrippedRecordingWithSymbolsDir) {
  require_setup();
  std::string work = tmpdir();
  Env env;
  env.unset("DEBUGINFOD_URLS");
  std::string rec = work + "/run.mtr";
  auto r = launch({"--record", rec});
  ASSERT_EQ(r.code, 0) << r.err;
  expect_unknown(r.report);

  auto plain = replay(rec);
  ASSERT_EQ(plain.code, 0) << plain.err;
  expect_unknown(plain.report);
  auto with = replay(rec, {"--symbols", kDebugDir});
  ASSERT_EQ(with.code, 0) << with.err;
  expect_symbolized(with.report);
  fs::remove_all(work);
}

// Symbolized elsewhere: the recorded program is gone from disk; replay gets
// the binary and its debug file from a debuginfod server by build-id.
TEST(Replay, MissingProgramAndDebugFileFromDebuginfod) {
  require_setup();
  std::string work = tmpdir();
  Env env;
  env.unset("DEBUGINFOD_URLS");
  env.set("DEBUGINFOD_CACHE_PATH", work + "/cache");
  fs::create_directories(work + "/gone");
  std::string copy = work + "/gone/stripped_target";
  fs::copy_file(kBin, copy);
  std::string rec = work + "/run.mtr";
  auto r = launch({"--record", rec}, copy);
  ASSERT_EQ(r.code, 0) << r.err;
  fs::remove_all(work + "/gone");

  auto lost = replay(rec);
  expect_unknown(lost.report, copy, "file gone");
  fs::create_directories(work + "/srv");
  fs::copy_file(kBin, work + "/srv/stripped_target");
  fs::copy_file(kDebugDir + "/stripped_target.debug", work + "/srv/stripped_target.debug");
  DebuginfodServer srv;
  std::string why = srv.start(work + "/srv", work);
  if (!why.empty()) MEMTRACE_SKIP_OR_FAIL(why);
  env.set("DEBUGINFOD_URLS", srv.url());
  auto found = replay(rec);
  ASSERT_EQ(found.code, 0) << found.err;
  expect_symbolized(found.report, copy);
  std::string notes = found.report.value("notes", json::array()).dump();
  EXPECT_NE(notes.find("symbolized with " + work + "/cache/"), std::string::npos) << notes;
  fs::remove_all(work);
}

// A --symbols DIR that is not a directory: one line naming it, exit 2 (tracing
// and replay), before anything is traced or read.
TEST(BadInput, SymbolsDirThatIsNotADirectory) {
  for (const std::vector<std::string>& argv :
       {std::vector<std::string>{tool(), "--symbols", "/nonexistent/dir", "--", kBin},
        std::vector<std::string>{tool(), "--symbols", TARGET_SOURCE, "--", kBin},
        std::vector<std::string>{tool(), "replay", "/nonexistent.mtr", "--symbols", "/nonexistent/dir"}}) {
    Child c = spawn(argv);
    close(c.in);
    std::string out = read_all(c.out), err = read_all(c.err);
    EXPECT_EQ(wait_exit(c.pid), 2) << err;
    close(c.out);
    close(c.err);
    EXPECT_EQ(out, "");
    EXPECT_EQ(count_lines(err, ""), 1u) << err;
    EXPECT_TRUE(err.find("--symbols " + argv[argv[1] == "replay" ? 4 : 2] + ": ") != std::string::npos) << err;
    EXPECT_TRUE(err.find("No such file or directory") != std::string::npos ||
                err.find("not a directory") != std::string::npos)
        << err;
  }
}
