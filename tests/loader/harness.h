// Runs memtrace-bpf and target programs for the integration tests.
#pragma once
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace memtrace::testing {

// valgrind's "in use at exit" and "total heap usage" lines of a command
// (its stderr and stdout go to the pipe).
struct ValgrindCounts {
  long inuse = -1, blocks = -1, allocs = -1, frees = -1, bytes = -1;
  // One line to compare, valgrind's against a report's (counts_of).
  std::string str() const {
    return "allocs " + std::to_string(allocs) + " frees " + std::to_string(frees) + " bytes " + std::to_string(bytes) +
           " in use " + std::to_string(inuse) + " bytes in " + std::to_string(blocks) + " blocks";
  }
};
inline ValgrindCounts valgrind_counts(const std::string& cmd) {
  FILE* f = popen(cmd.c_str(), "r");
  std::string vg;
  char b[4096];
  size_t n;
  while ((n = fread(b, 1, sizeof b, f)) > 0) vg.append(b, n);
  pclose(f);
  vg.erase(std::remove(vg.begin(), vg.end(), ','), vg.end());
  ValgrindCounts v;
  if (auto at = vg.find("in use at exit:"); at != std::string::npos)
    sscanf(vg.c_str() + at, "in use at exit: %ld bytes in %ld blocks", &v.inuse, &v.blocks);
  if (auto at = vg.find("total heap usage:"); at != std::string::npos)
    sscanf(vg.c_str() + at, "total heap usage: %ld allocs %ld frees %ld bytes allocated", &v.allocs, &v.frees,
           &v.bytes);
  return v;
}

// valgrind's counts of sqlite3 on the script the valgrind comparisons feed
// it on stdin (a table of 2000 rows, an index, an update, a query), written
// to *sql; or why not in *missing.
inline ValgrindCounts sqlite_valgrind_counts(std::string* sql, std::string* missing) {
  if (access("/usr/bin/valgrind", X_OK) != 0 || access("/usr/bin/sqlite3", X_OK) != 0) {
    *missing = "valgrind or sqlite3 missing (scripts/deps.txt installs them)";
    return {};
  }
  *sql = "/tmp/memtrace-test-sqlite.sql";
  {
    std::ofstream s(*sql);
    s << "CREATE TABLE t(a INTEGER, b TEXT);\nBEGIN;\n";
    for (int i = 0; i < 2000; i++) s << "INSERT INTO t VALUES(" << i << ", 'row" << i * 7 << "');\n";
    s << "COMMIT;\nCREATE INDEX ti ON t(b);\nUPDATE t SET b = b || 'x' WHERE a % 3 = 0;\n"
      << "SELECT count(*), sum(length(b)) FROM t;\n";
  }
  return valgrind_counts("valgrind --run-libc-freeres=no /usr/bin/sqlite3 :memory: < " + *sql + " 2>&1 >/dev/null");
}

inline std::string tool() { return MEMTRACE_BIN; }
// Debian's golang-go (`go tool pprof` reads the pprof outputs); "": none.
inline std::string go_binary() {
  for (const char* p : {"/usr/bin/go", "/usr/lib/go/bin/go", "/usr/local/go/bin/go"})
    if (access(p, X_OK) == 0) return p;
  return "";
}
inline std::string target(const std::string& name) { return std::string(TARGET_DIR) + "/" + name; }

struct Child {
  pid_t pid = -1;
  int in = -1;   // write end of the child's stdin
  int out = -1;  // read end of the child's stdout
  int err = -1;  // read end of the child's stderr
};

inline Child spawn(const std::vector<std::string>& argv) {
  int i[2], o[2], e[2];
  if (pipe2(i, O_CLOEXEC) || pipe2(o, O_CLOEXEC) || pipe2(e, O_CLOEXEC)) abort();
  pid_t pid = fork();
  if (pid == 0) {
    dup2(i[0], 0);
    dup2(o[1], 1);
    dup2(e[1], 2);
    std::vector<char*> a;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(127);
  }
  close(i[0]);
  close(o[1]);
  close(e[1]);
  return Child{pid, i[1], o[0], e[0]};
}

inline std::string read_all(int fd) {
  std::string s;
  char b[65536];
  ssize_t n;
  while ((n = read(fd, b, sizeof b)) > 0) s.append(b, n);
  return s;
}

// Reads fd until a line containing `needle` arrives (or EOF / timeout).
inline bool read_until(int fd, const std::string& needle, std::string* acc, int timeout_ms = 20000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char b[4096];
  while (std::chrono::steady_clock::now() < end) {
    if (acc->find(needle) != std::string::npos) return true;
    fd_set fs;
    FD_ZERO(&fs);
    FD_SET(fd, &fs);
    timeval tv{0, 100000};
    if (select(fd + 1, &fs, nullptr, nullptr, &tv) > 0) {
      ssize_t n = read(fd, b, sizeof b);
      if (n <= 0) return acc->find(needle) != std::string::npos;
      acc->append(b, n);
    }
  }
  return acc->find(needle) != std::string::npos;
}

inline int wait_exit(pid_t pid) {
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

struct ToolRun {
  int code = -1;
  std::string out, err;
  nlohmann::json report;
  std::string lines;  // what the -o file holds before the report (--trace, --trace-faults)
};

// An -o file: trace lines (one per line), then the report (text or JSON
// pretty-printed: its first line is "{"). Returns the report's offset.
inline size_t report_offset(const std::string& file) {
  if (file.rfind("{\n", 0) == 0) return 0;
  size_t at = file.rfind("\n{\n");
  return at == std::string::npos ? 0 : at + 1;
}

inline std::string tmpfile(const std::string& tag) {
  static int n = 0;
  return "/tmp/memtrace-test-" + std::to_string(getpid()) + "-" + tag + "-" + std::to_string(n++) + ".json";
}

// argv to completion, stdin closed: exit code, stdout, stderr.
inline ToolRun run_argv(const std::vector<std::string>& argv) {
  Child c = spawn(argv);
  close(c.in);
  ToolRun r;
  std::thread t([&] { r.err = read_all(c.err); });
  r.out = read_all(c.out);
  t.join();
  r.code = wait_exit(c.pid);
  close(c.out);
  close(c.err);
  return r;
}

// memtrace-bpf ARGS with a JSON report, to completion.
inline ToolRun run_tool(std::vector<std::string> args) {
  std::string rep = tmpfile("r");
  std::vector<std::string> argv = {tool(), "--format", "json", "-o", rep};
  argv.insert(argv.end(), args.begin(), args.end());
  ToolRun r = run_argv(argv);
  std::ifstream f(rep);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string file = ss.str();
  size_t at = report_offset(file);
  r.lines = file.substr(0, at);
  if (!file.empty()) r.report = nlohmann::json::parse(file.substr(at), nullptr, false);
  unlink(rep.c_str());
  return r;
}

// pid's current image (its last entry: one per exec'd image, in exec order).
inline const nlohmann::json* find_proc(const nlohmann::json& rep, pid_t pid) {
  if (!rep.is_object() || !rep.contains("processes")) return nullptr;
  const nlohmann::json* last = nullptr;
  for (const auto& p : rep["processes"])
    if (p["pid"] == pid) last = &p;
  return last;
}

inline const nlohmann::json* find_comm(const nlohmann::json& rep, const std::string& comm) {
  if (!rep.is_object() || !rep.contains("processes")) return nullptr;
  for (const auto& p : rep["processes"])
    if (p["comm"] == comm) return &p;
  return nullptr;
}

struct PerRound {
  long allocs = 0, frees = 0, bytes = 0, failed = 0, leaked_blocks = 0, leaked_bytes = 0, mmap_direct = 0;
};

inline PerRound parse_per_round(const std::string& out) {
  PerRound p;
  auto at = out.find("per_round");
  if (at != std::string::npos)
    sscanf(out.c_str() + at,
           "per_round allocs=%ld frees=%ld bytes=%ld failed=%ld leaked_blocks=%ld leaked_bytes=%ld "
           "mmap_direct=%ld",
           &p.allocs, &p.frees, &p.bytes, &p.failed, &p.leaked_blocks, &p.leaked_bytes, &p.mmap_direct);
  return p;
}

inline long u(const nlohmann::json& p, const char* k) { return p["summary"][k].get<long>(); }

// Nothing the report counts as lost was lost.
inline void expect_no_losses(const nlohmann::json& rep) {
  ASSERT_TRUE(rep.contains("dropped")) << rep.dump();
  for (const char* k : {"ringbuf", "stack_ringbuf", "inflight_map_full", "stack_record_missing", "malformed",
                        "missed_returns", "stop_failed"})
    EXPECT_EQ(rep["dropped"][k].get<long>(), 0) << k << " in " << rep["dropped"].dump();
}
// A report's process summary as valgrind's counts.
inline ValgrindCounts counts_of(const nlohmann::json& p) {
  return {u(p, "in_use_bytes"), u(p, "in_use_blocks"), u(p, "allocs"), u(p, "frees"), u(p, "bytes_allocated")};
}

// `memtrace-bpf --check` on this kernel (run once): tests of features a
// kernel may lack (bpf_find_vma before 5.17, ...) assert what the tool does
// there instead, which --check announces with a "fallback" line.
inline const std::string& kernel_check() {
  static std::string out = [] {
    Child c = spawn({tool(), "--check"});
    close(c.in);
    std::string o = read_all(c.out);
    read_all(c.err);
    wait_exit(c.pid);
    return o;
  }();
  return out;
}
// "page faults", "stacks", ... : does --check say the best mechanism is used?
inline bool kernel_ok(const std::string& feature) {
  return kernel_check().find("ok       " + feature + ":") != std::string::npos;
}

// BPF program and link ids a process holds (from its fds' fdinfo).
inline std::set<std::string> bpf_ids_of(pid_t pid) {
  std::set<std::string> ids;
  std::string dir = "/proc/" + std::to_string(pid) + "/fdinfo";
  DIR* d = opendir(dir.c_str());
  if (!d) return ids;
  while (dirent* e = readdir(d)) {
    std::ifstream f(dir + "/" + e->d_name);
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("prog_id:", 0) == 0 || line.rfind("link_id:", 0) == 0)
        ids.insert(line.substr(0, 4) + std::to_string(std::stol(line.substr(line.find(':') + 1))));
  }
  closedir(d);
  return ids;
}

// Which of these ids still exist anywhere in the kernel.
inline std::set<std::string> still_loaded(const std::set<std::string>& ids) {
  std::set<std::string> left;
  for (const char* kind : {"prog", "link"}) {
    FILE* f = popen((std::string("bpftool -j ") + kind + " list 2>/dev/null").c_str(), "r");
    std::string s;
    char b[65536];
    size_t n;
    while ((n = fread(b, 1, sizeof b, f)) > 0) s.append(b, n);
    pclose(f);
    auto j = nlohmann::json::parse(s, nullptr, false);
    if (!j.is_array()) continue;
    for (const auto& p : j) {
      std::string id = std::string(kind).substr(0, 4) + std::to_string(p.value("id", -1L));
      if (ids.count(id)) left.insert(id);
    }
  }
  return left;
}

}  // namespace memtrace::testing
