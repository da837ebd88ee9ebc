// --inject with the program's own allocator (issue 33): jemalloc, tcmalloc
// and mimalloc preloaded (Debian's libjemalloc2, libtcmalloc-minimal4,
// libmimalloc2.0), the allocator found as the BPF path finds it, its
// malloc family, C++ new/delete and jemalloc's *allocx entries hooked;
// counts exact, equal to the BPF path's. And Debian's redis-server (linked
// with libjemalloc): a known number of SETs seen, redis serving after the
// tool ends and after it is SIGKILLed; its stacks by the agent's CFI walk
// equal to libunwind's.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "test_env.h"
#include "../loader/harness.h"
#include "inject_util.h"

using json = nlohmann::json;
using namespace memtrace::testing;

namespace {

struct Lib {
  const char* family;
  const char* path;
};
const Lib kLibs[] = {{"jemalloc", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
                     {"tcmalloc", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"},
                     {"mimalloc", "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"}};

const Lib& lib_of(const std::string& family) {
  for (const auto& l : kLibs)
    if (family == l.family) return l;
  return kLibs[0];
}

// inject_target under LD_PRELOAD=lib: --inject -p goes in (no fallback
// line), the counts exactly the target's; then the BPF path on the same
// workload (MODE stdin), the same counts.
void preloaded_exact(const std::string& family) {
  MEMTRACE_REQUIRE_ROOT();
  const Lib& l = lib_of(family);
  if (access(l.path, R_OK) != 0) MEMTRACE_SKIP_OR_FAIL(std::string(l.path) + " missing (scripts/deps.txt)");
  std::string preload = std::string("LD_PRELOAD=") + l.path;
  Expect inj, bpf;
  for (bool inject : {true, false}) {
    Child t = spawn({"/usr/bin/env", preload, std::string(TARGET_DIR) + "/inject_target", "2000",
                     inject ? "exit" : "stdin"});
    if (inject) close(t.in);
    std::string tout;
    pid_t pid = ready_pid(t, &tout);
    ASSERT_EQ(pid, t.pid) << tout;
    std::string rep = tmpfile("prealloc");
    std::vector<std::string> argv = {MEMTRACE_BIN, "--format", "json", "-o", rep, "-v", "-p", std::to_string(pid)};
    if (inject) argv.insert(argv.begin() + 1, "--inject");
    Child m = spawn(argv);
    close(m.in);
    std::string merr;
    ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
    if (!inject) {
      ASSERT_EQ(write(t.in, "\n", 1), 1);
      close(t.in);
    }
    ASSERT_TRUE(read_until(t.out, "expect", &tout)) << tout;
    ASSERT_TRUE(read_until(t.out, "\n", &tout)) << tout;
    EXPECT_EQ(exit_within(t.pid, 30000), 0) << tout;
    EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;
    read_until(m.err, "\x01", &merr, 200);
    if (inject) {
      EXPECT_EQ(merr.find("traced with uprobes instead"), std::string::npos) << merr;
      EXPECT_NE(merr.find("allocator " + family), std::string::npos) << merr;
    }
    json j = json::parse(slurp_file(rep), nullptr, false);
    unlink(rep.c_str());
    const json* p = find_proc(j, pid);
    ASSERT_TRUE(p) << j.dump() << merr;
    Expect e = parse_expect(tout);
    expect_report_exact(*p, e);
    if (inject) expect_nothing_dropped(j);
    (inject ? inj : bpf) = e;
  }
  EXPECT_EQ(inj.allocs, bpf.allocs);
}

}  // namespace

TEST(InjectAllocators, PreloadedJemallocExact) { preloaded_exact("jemalloc"); }

// jemalloc linked into the executable (libjemalloc_pic.a): the program
// calls its own malloc family directly (no GOT slot): the entry
// trampolines see every call; exact, every entry patched.
TEST(InjectAllocators, LinkedInJemallocExact) {
  MEMTRACE_REQUIRE_ROOT();
  std::string target = std::string(TARGET_DIR) + "/inject_target_jemalloc";
  if (access(target.c_str(), X_OK) != 0) MEMTRACE_SKIP_OR_FAIL(target + " not built (libjemalloc-dev: scripts/deps.txt)");
  Child t = spawn({target, "2000"});
  close(t.in);
  std::string tout;
  pid_t pid = ready_pid(t, &tout);
  ASSERT_EQ(pid, t.pid) << tout;
  std::string rep = tmpfile("linkedje");
  Child m = spawn({MEMTRACE_BIN, "--format", "json", "-o", rep, "-v", "--inject", "-p", std::to_string(pid)});
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  EXPECT_EQ(merr.find("traced with uprobes instead"), std::string::npos) << merr;
  EXPECT_EQ(merr.find("entry not patched"), std::string::npos) << merr;
  EXPECT_NE(merr.find("allocator jemalloc in " + target), std::string::npos) << merr;
  ASSERT_TRUE(read_until(t.out, "expect", &tout)) << tout;
  ASSERT_TRUE(read_until(t.out, "\n", &tout)) << tout;
  EXPECT_EQ(exit_within(t.pid, 30000), 0) << tout;
  EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;
  json j = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  const json* p = find_proc(j, pid);
  ASSERT_TRUE(p) << merr;
  expect_report_exact(*p, parse_expect(tout));
  expect_nothing_dropped(j);
}
TEST(InjectAllocators, PreloadedTcmallocExact) { preloaded_exact("tcmalloc"); }
TEST(InjectAllocators, PreloadedMimallocExact) { preloaded_exact("mimalloc"); }

namespace {

// cxx_new under LD_PRELOAD=lib, launched with --inject (or on the BPF
// path: the allocator's own new/delete probed): R rounds less 0
// rounds is R times its per_round line (the allocator's own operator
// new/delete, sized and aligned: the sizes as asked, its aligned new does
// not round them).
void cxx_under(const std::string& family, bool inject = true) {
  MEMTRACE_REQUIRE_ROOT();
  const Lib& l = lib_of(family);
  if (access(l.path, R_OK) != 0) MEMTRACE_SKIP_OR_FAIL(std::string(l.path) + " missing (scripts/deps.txt)");
  const long R = 200;
  auto run = [&](long rounds, std::string* out) -> json {
    std::string rep = tmpfile("cxxpre");
    std::vector<std::string> argv = {"/usr/bin/env", std::string("LD_PRELOAD=") + l.path, MEMTRACE_BIN, "--format",
                                     "json", "-o", rep, "--", CXX_NEW, "--rounds", std::to_string(rounds)};
    if (inject) argv.insert(argv.begin() + 7, "--inject");
    ToolRun r = run_argv(argv);
    *out = r.out + r.err;
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err.find("traced with uprobes instead"), std::string::npos) << r.err;
    json j = json::parse(slurp_file(rep), nullptr, false);
    unlink(rep.c_str());
    return j;
  };
  std::string o0, on;
  json j0 = run(0, &o0), jn = run(R, &on);
  const json* p0 = find_comm(j0, "cxx_new");
  const json* pn = find_comm(jn, "cxx_new");
  ASSERT_TRUE(p0 && pn) << o0 << on;
  long a = 0, f = 0, b = 0, lb = 0, ly = 0;
  auto at = on.find("per_round ");
  ASSERT_NE(at, std::string::npos) << on;
  sscanf(on.c_str() + at, "per_round allocs=%ld frees=%ld bytes=%ld failed=0 leaked_blocks=%ld leaked_bytes=%ld", &a,
         &f, &b, &lb, &ly);
  EXPECT_EQ(u(*pn, "allocs") - u(*p0, "allocs"), R * a) << on;
  EXPECT_EQ(u(*pn, "frees") - u(*p0, "frees"), R * f) << on;
  EXPECT_EQ(u(*pn, "bytes_allocated") - u(*p0, "bytes_allocated"), R * b) << on;
  EXPECT_EQ(u(*pn, "in_use_blocks") - u(*p0, "in_use_blocks"), R * lb) << on;
  EXPECT_EQ(u(*pn, "in_use_bytes") - u(*p0, "in_use_bytes"), R * ly) << on;
}

}  // namespace

TEST(InjectAllocators, CxxNewDeleteUnderPreloadedJemalloc) { cxx_under("jemalloc"); }
TEST(InjectAllocators, CxxNewDeleteUnderPreloadedTcmalloc) { cxx_under("tcmalloc"); }
TEST(InjectAllocators, CxxNewDeleteUnderPreloadedMimalloc) { cxx_under("mimalloc"); }
TEST(InjectAllocators, CxxNewDeleteUnderPreloadedJemallocOnTheBpfPath) { cxx_under("jemalloc", false); }
TEST(InjectAllocators, CxxNewDeleteUnderPreloadedTcmallocOnTheBpfPath) { cxx_under("tcmalloc", false); }
TEST(InjectAllocators, CxxNewDeleteUnderPreloadedMimallocOnTheBpfPath) { cxx_under("mimalloc", false); }

namespace {

// One RESP command to 127.0.0.1:port and its reply (up to the first CRLF;
// enough for +OK, +PONG, :N).
std::string redis_call(int port, const std::vector<std::string>& args) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return "";
  }
  std::string req = "*" + std::to_string(args.size()) + "\r\n";
  for (const auto& s : args) req += "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n";
  std::string rep;
  if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
    char buf[256];
    while (rep.find("\r\n") == std::string::npos) {
      ssize_t n = read(fd, buf, sizeof buf);
      if (n <= 0) break;
      rep.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return rep.substr(0, rep.find("\r\n"));
}

// SETs of N distinct keys, one connection, pipelined: the replies read.
bool redis_sets(int port, int n, size_t value_bytes, const std::string& prefix = "k") {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return false;
  std::string value(value_bytes, 'v');
  for (int i = 0; i < n; i++) {
    std::string key = prefix + std::to_string(100000 + i);
    std::string req = "*3\r\n$3\r\nSET\r\n$" + std::to_string(key.size()) + "\r\n" + key + "\r\n$" +
                      std::to_string(value.size()) + "\r\n" + value + "\r\n";
    if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) return false;
    char buf[8];
    size_t got = 0;
    while (got < 5) {  // "+OK\r\n"
      ssize_t r = read(fd, buf, 5 - got);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
  }
  close(fd);
  return true;
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

// redis-server on loopback (no persistence), waited for until it answers.
pid_t start_redis(int port) {
  pid_t pid = fork();
  if (pid == 0) {
    int null = open("/dev/null", O_RDWR);
    dup2(null, 1);
    execl("/usr/bin/redis-server", "redis-server", "--port", std::to_string(port).c_str(), "--bind", "127.0.0.1",
          "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes", (char*)nullptr);
    _exit(127);
  }
  for (int i = 0; i < 500; i++) {
    if (redis_call(port, {"PING"}) == "+PONG") return pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

// redis-server under --inject -p: N SETs of V-byte values to new keys are
// N values alive at the end, allocated under zmalloc (the report's leaks:
// a site of N blocks of at least V bytes each, zmalloc in its stack); the
// agent went in (no fallback line); redis answers PING after the tool.
void redis_inject(bool sigkill) {
  MEMTRACE_REQUIRE_ROOT();
  if (access("/usr/bin/redis-server", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("redis-server missing (scripts/deps.txt)");
  int port = free_port();
  pid_t r = start_redis(port);
  ASSERT_GT(r, 0) << "redis-server did not answer on port " << port;
  std::string rep = tmpfile("redis");
  Child m = spawn({MEMTRACE_BIN, "--format", "json", "-o", rep, "-v", "--inject", "-p", std::to_string(r)});
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  EXPECT_EQ(merr.find("traced with uprobes instead"), std::string::npos) << merr;
  const int N = 3000;
  const size_t V = 1500;
  EXPECT_TRUE(redis_sets(port, N, V));
  EXPECT_EQ(redis_call(port, {"DBSIZE"}), ":" + std::to_string(N));
  if (sigkill) {
    kill(m.pid, SIGKILL);
    EXPECT_EQ(exit_within(m.pid, 30000), 128 + SIGKILL);
  } else {
    kill(m.pid, SIGINT);
    EXPECT_EQ(exit_within(m.pid, 60000), 0) << merr;
  }
  // Serving after the tool, and its hooks not recording: more SETs, PING.
  EXPECT_TRUE(redis_sets(port, 200, V));
  EXPECT_EQ(redis_call(port, {"PING"}), "+PONG");
  EXPECT_EQ(redis_call(port, {"DBSIZE"}), ":" + std::to_string(N));  // the same keys again
  if (!sigkill) {
    json j = json::parse(slurp_file(rep), nullptr, false);
    const json* p = find_proc(j, r);
    ASSERT_TRUE(p) << merr;
    expect_nothing_dropped(j);
    EXPECT_GE(u(*p, "allocs"), N);
    // The values: one site of N blocks (V bytes and redis's sds header each).
    const json* site = nullptr;
    for (const auto& l : (*p)["leaks"])
      if (l["blocks"].get<long>() == N && l["bytes"].get<long>() >= static_cast<long>(N * V) &&
          l["bytes"].get<long>() < static_cast<long>(N * (V + 64)))
        site = &l;
    ASSERT_TRUE(site) << (*p)["leaks"].dump().substr(0, 4000);
    bool zmalloc = false;
    for (const auto& f : (*site)["stack"]) zmalloc |= f.value("function", "").rfind("zmalloc", 0) == 0 ||
                                                       f.value("function", "").rfind("ztrymalloc", 0) == 0;
    EXPECT_TRUE(zmalloc) << site->dump();
  }
  unlink(rep.c_str());
  kill(r, SIGTERM);
  EXPECT_EQ(exit_within(r, 20000), 0);
}

// One --inject -p session on redis under MEMTRACE_INJECT_UNWIND=mode: N
// SETs of V-byte values to new keys (prefix), then redis-benchmark's
// `-n B -t set,get,lpush` (its key and its list: 2 keys more), SIGINT.
// The report; *site: the stack of the SETs' values (the leak site of N
// blocks), "function@address" a frame.
struct RedisRun {
  json rep;
  std::vector<std::string> site;
  std::string err;
};
void redis_traced(pid_t r, int port, const std::string& mode, const std::string& prefix, int n, size_t v, int bench,
                  RedisRun* out) {
  std::string rep = tmpfile("redis-cfi");
  Child m = spawn({"/usr/bin/env", "MEMTRACE_INJECT_UNWIND=" + mode, MEMTRACE_BIN, "--format", "json", "-o", rep, "-v",
                   "--inject", "-p", std::to_string(r)});
  close(m.in);
  ASSERT_TRUE(read_until(m.err, "tracing", &out->err)) << out->err;
  EXPECT_EQ(out->err.find("traced with uprobes instead"), std::string::npos) << out->err;
  EXPECT_NE(out->err.find(mode == "libunwind" ? "stacks by libunwind" : "stacks by CFI rows"), std::string::npos)
      << out->err;
  EXPECT_TRUE(redis_sets(port, n, v, prefix));
  std::string cmd = "redis-benchmark -h 127.0.0.1 -p " + std::to_string(port) + " -c 20 -n " + std::to_string(bench) +
                    " -t set,get,lpush -q >/dev/null 2>&1";
  EXPECT_EQ(system(cmd.c_str()), 0) << cmd;
  kill(m.pid, SIGINT);
  EXPECT_EQ(exit_within(m.pid, 60000), 0) << out->err;
  read_until(m.err, "\x01", &out->err, 200);
  out->rep = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  const json* p = find_proc(out->rep, r);
  ASSERT_TRUE(p) << out->err;
  expect_nothing_dropped(out->rep);
  EXPECT_EQ(out->rep["dropped"]["inject_stack_cut"].get<long>(), 0);
  for (const auto& l : (*p)["leaks"])
    if (l["blocks"].get<long>() == n && l["bytes"].get<long>() >= static_cast<long>(n * v) &&
        l["bytes"].get<long>() < static_cast<long>(n * (v + 64))) {
      EXPECT_TRUE(out->site.empty()) << "two sites of " << n << " blocks";
      for (const auto& f : l["stack"])
        out->site.push_back(f.value("function", "") + "@" + f.value("address", ""));
    }
  EXPECT_FALSE(out->site.empty()) << (*p)["leaks"].dump().substr(0, 4000);
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& f : v) s += (s.empty() ? "" : " < ") + f;
  return s;
}

}  // namespace

TEST(InjectAllocators, RedisSetsCountedAndServingAfterTheTool) { redis_inject(false); }
TEST(InjectAllocators, RedisServingAfterTheToolIsKilled) { redis_inject(true); }

// The agent's CFI walk (the default) on a real program (issue 33): one
// redis-server (no frame pointers), traced three times in turn:
// MEMTRACE_INJECT_UNWIND=verify (every walk of the rows compared with
// libunwind's inside redis: none differs), =libunwind, and the default.
// The SETs' values have the stack gdb shows for them (malloc's caller
// zmalloc_usable < _sdsnewlen < createStringObject < processMultibulkBuffer
// < processInputBuffer < readQueryFromClient ... aeMain < main), the same
// frames at the same addresses in all three reports.
TEST(InjectAllocators, RedisCfiStacksAreLibunwinds) {
  MEMTRACE_REQUIRE_ROOT();
  if (access("/usr/bin/redis-server", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("redis-server missing (scripts/deps.txt)");
  if (access("/usr/bin/redis-benchmark", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("redis-benchmark missing (scripts/deps.txt)");
  int port = free_port();
  pid_t r = start_redis(port);
  ASSERT_GT(r, 0) << "redis-server did not answer on port " << port;
  const int N = 2000, B = 10000;
  const size_t V = 1500;
  RedisRun verify, unw, cfi;
  redis_traced(r, port, "verify", "v", N, V, B, &verify);
  redis_traced(r, port, "libunwind", "u", N, V, B, &unw);
  redis_traced(r, port, "cfi", "c", N, V, B, &cfi);
  EXPECT_EQ(redis_call(port, {"DBSIZE"}), ":" + std::to_string(3 * N + 2));  // the SETs' keys, the bench's key and list
  EXPECT_EQ(redis_call(port, {"PING"}), "+PONG");
  const json& vs = verify.rep["stats"];
  // Every stack of N SETs and 3 x B requests walked by the rows and checked.
  EXPECT_GT(vs["inject_stack_verified"].get<long>(), N + 3 * B) << vs.dump();
  EXPECT_EQ(vs["inject_stack_mismatch"].get<long>(), 0) << vs.dump();
  EXPECT_EQ(unw.rep["stats"]["inject_stack_verified"].get<long>(), 0);
  EXPECT_EQ(unw.rep["stats"]["inject_stack_slow"].get<long>(), 0);  // not the rows' walk at all
  EXPECT_EQ(cfi.rep["stats"]["inject_stack_verified"].get<long>(), 0);
  EXPECT_EQ(cfi.rep["stats"]["inject_stack_mismatch"].get<long>(), 0);
  printf("verify: %ld walks compared, %ld differed, %ld libunwind's; default: %ld libunwind's\n",
         vs["inject_stack_verified"].get<long>(), vs["inject_stack_mismatch"].get<long>(),
         vs["inject_stack_slow"].get<long>(), cfi.rep["stats"]["inject_stack_slow"].get<long>());
  printf("SET values: %s\n", joined(cfi.site).c_str());
  // redis's own functions, in gdb's order, up to main.
  std::vector<std::string> want = {"zmalloc_usable", "_sdsnewlen", "createStringObject", "processMultibulkBuffer",
                                   "processInputBuffer", "readQueryFromClient", "aeMain", "main"};
  size_t at = 0;
  for (const auto& f : cfi.site)
    if (at < want.size() && f.rfind(want[at] + "@", 0) == 0) at++;
  EXPECT_EQ(at, want.size()) << joined(cfi.site);
  EXPECT_EQ(joined(cfi.site), joined(unw.site));
  EXPECT_EQ(joined(verify.site), joined(unw.site));
  kill(r, SIGTERM);
  EXPECT_EQ(exit_within(r, 20000), 0);
}
