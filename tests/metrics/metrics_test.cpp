// --metrics on the real tool (issue 19): tests/targets/alloc_rounds, which
// knows its counts and waits on stdin at two points, is scraped at both:
// the difference is exactly N rounds, the second scrape is the final
// report; promtool accepts the scrapes; the cap and an exited child; a real
// Prometheus server scrapes the tool and answers a query; bad addresses.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <thread>

#include "harness.h"
#include "procfs/cgroup.h"
#include "scrape.h"
#include "shell.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

// A traced process's series: its cgroup is a label too, the test's own
// (which its children inherit).
std::string pseries(const std::string& name, long pid, const std::string& comm, const std::string& by = "") {
  static const std::string cg = memtrace::procfs::cgroup_of(getpid()).value_or("");
  return series(name, pid, comm, by, cg);
}

constexpr long kRounds = 40;

class Metrics : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    if (access("/usr/bin/promtool", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/promtool (Debian prometheus)");
  }
};

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `promtool check metrics` on a scrape: "" if it passes, else what it said.
std::string promtool_says(const std::string& text) {
  std::string path = "/tmp/metrics-test-" + std::to_string(getpid()) + ".txt";
  std::ofstream(path) << text;
  std::string out = shell_output("/usr/bin/promtool check metrics < " + path + " 2>&1; echo rc=$?");
  unlink(path.c_str());
  return out == "rc=0\n" ? "" : out;
}

// Until pid sits in read(2) (its stdio buffer for stdin is allocated at the
// first fgets, after it printed "ready"): then its counts are settled.
bool blocked_in_read(long pid) {
  for (int i = 0; i < 500; i++) {
    if (slurp("/proc/" + std::to_string(pid) + "/syscall").rfind("0 0x0 ", 0) == 0) return true;  // read(0, ...)
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

// memtrace-bpf --metrics 127.0.0.1:0 ... -- alloc_rounds --wait ARGS: the
// program waits at "ready" (point 1) and after its rounds (point 2).
struct Traced {
  Child m;
  std::string out, err, report_path = tmpfile("metrics");
  uint16_t port = 0;
  long pid = 0;
  PerRound per;
  json report;
  bool start(std::vector<std::string> tool_args, std::vector<std::string> target_args) {
    std::vector<std::string> argv = {tool(), "--metrics", "127.0.0.1:0", "--format", "json", "-o", report_path};
    argv.insert(argv.end(), tool_args.begin(), tool_args.end());
    argv.insert(argv.end(), {"--", target("alloc_rounds"), "--wait", "--rounds", std::to_string(kRounds)});
    argv.insert(argv.end(), target_args.begin(), target_args.end());
    m = spawn(argv);
    if (!read_until(m.err, "/metrics\n", &err) || !read_until(m.out, "ready", &out) ||
        !read_until(m.out, "\n", &out))
      return false;
    std::smatch mm;
    if (!std::regex_search(err, mm, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) return false;
    port = std::stoi(mm[1]);
    pid = std::stol(out.substr(out.find("ready ") + 6));
    return blocked_in_read(pid);
  }
  bool release_rounds() {  // to point 2
    if (write(m.in, "\n", 1) != 1) return false;
    if (!read_until(m.out, "per_round", &out) || !read_until(m.out, "mmap_direct=", &out)) return false;
    per = parse_per_round(out);
    return per.allocs > 0 && blocked_in_read(pid);
  }
  int finish() {  // the program exits; the tool's report
    if (write(m.in, "\n", 1) != 1) {}
    close(m.in);
    std::thread drain([&] { err += read_all(m.err); });
    out += read_all(m.out);
    drain.join();
    int code = wait_exit(m.pid);
    m.pid = -1;
    report = json::parse(slurp(report_path), nullptr, false);
    unlink(report_path.c_str());
    return code;
  }
  std::string scrape() {
    HttpReply r = http_get(port, "/metrics");
    EXPECT_EQ(r.status, 200) << err;
    return r.body;
  }
  ~Traced() {
    if (m.pid > 0) {
      kill(m.pid, SIGTERM);
      wait_exit(m.pid);
    }
    unlink(report_path.c_str());
  }
};

TEST_F(Metrics, ScrapesAtKnownPointsAreExact) {
  Traced t;
  ASSERT_TRUE(t.start({}, {})) << t.err << t.out;
  std::string s1 = t.scrape();
  // A client that connects and sends nothing holds the server (not the
  // tracing) until its 2 s are up: the rounds are traced meanwhile.
  int silent = connect_local(t.port);
  ASSERT_GE(silent, 0);
  ASSERT_TRUE(t.release_rounds()) << t.out << t.err;
  std::string s2 = t.scrape();
  close(silent);
  Exposition e1 = parse_exposition(s1), e2 = parse_exposition(s2);
  EXPECT_EQ(promtool_says(s1), "");
  EXPECT_EQ(promtool_says(s2), "");
  EXPECT_EQ(e1.duplicates + e2.duplicates, 0);
  const std::string comm = "alloc_rounds";
  auto diff = [&](const std::string& name, const std::string& by = "") {
    return e2.value(pseries(name, t.pid, comm, by)) - e1.value(pseries(name, t.pid, comm, by));
  };
  ASSERT_TRUE(e1.has(pseries("memtrace_heap_in_use_bytes", t.pid, comm))) << s1;
  EXPECT_EQ(diff("memtrace_heap_in_use_bytes"), kRounds * t.per.leaked_bytes);
  EXPECT_EQ(diff("memtrace_heap_in_use_blocks"), kRounds * t.per.leaked_blocks);
  EXPECT_EQ(diff("memtrace_allocations_total"), kRounds * t.per.allocs);
  EXPECT_EQ(diff("memtrace_frees_total"), kRounds * t.per.frees);
  EXPECT_EQ(diff("memtrace_allocated_bytes_total"), kRounds * t.per.bytes);
  EXPECT_EQ(diff("memtrace_failed_allocations_total"), kRounds * t.per.failed);
  EXPECT_EQ(diff("memtrace_mmap_bytes_total", "program"), kRounds * t.per.mmap_direct);
  for (const char* k : {"ringbuf", "stack_ringbuf", "inflight_map_full", "stack_record_missing", "malformed",
                        "missed_returns", "stop_failed"})
    EXPECT_EQ(e2.value("memtrace_dropped_total{kind=\"" + std::string(k) + "\"}"), 0) << k;
  EXPECT_GT(e2.value("memtrace_events_total"), e1.value("memtrace_events_total"));
  EXPECT_GT(e2.value("memtrace_ringbuf_size_bytes"), 0);
  EXPECT_EQ(e2.value("memtrace_processes_exported"), 1);

  // Point 2 is the end: the second scrape says what the final report says.
  ASSERT_EQ(t.finish(), 0) << t.err;
  const json* p = find_proc(t.report, t.pid);
  ASSERT_TRUE(p) << t.report.dump();
  const json& sm = (*p)["summary"];
  EXPECT_EQ(e2.value(pseries("memtrace_heap_in_use_bytes", t.pid, comm)), sm["in_use_bytes"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_heap_in_use_blocks", t.pid, comm)), sm["in_use_blocks"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_heap_peak_in_use_bytes", t.pid, comm)), sm["peak_in_use_bytes"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_allocations_total", t.pid, comm)), sm["allocs"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_frees_total", t.pid, comm)), sm["frees"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_allocated_bytes_total", t.pid, comm)), sm["bytes_allocated"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_mmap_bytes_total", t.pid, comm, "program")), sm["mmap_bytes_direct"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_mmap_bytes_total", t.pid, comm, "allocator")),
            sm["mmap_bytes_allocator"].get<long>());
  EXPECT_EQ(e2.value(pseries("memtrace_mapped_bytes", t.pid, comm, "program")), sm["mapped_now_direct"].get<long>());
}

TEST_F(Metrics, CapAndAnExitedChild) {
  // One process with series of its own: the parent (the first seen); its
  // child, forked for the rounds and gone before point 2, is `other` in two
  // scrapes with its final counts, then dropped.
  Traced t;
  ASSERT_TRUE(t.start({"--metrics-max-processes", "1"}, {"--fork"})) << t.err << t.out;
  std::string s1 = t.scrape();
  ASSERT_TRUE(parse_exposition(s1).has(pseries("memtrace_heap_in_use_bytes", t.pid, "alloc_rounds"))) << s1;
  ASSERT_TRUE(t.release_rounds()) << t.out << t.err;
  std::vector<Exposition> after;
  for (int i = 0; i < 3; i++) {
    std::string s = t.scrape();
    EXPECT_EQ(promtool_says(s), "");
    after.push_back(parse_exposition(s));
  }
  ASSERT_EQ(t.finish(), 0) << t.err;
  const json* child = nullptr;
  for (const auto& p : t.report["processes"])
    if (p["pid"] != t.pid) child = &p;
  ASSERT_TRUE(child) << t.report.dump();
  const json& cs = (*child)["summary"];
  const std::string other = "{pid=\"other\",comm=\"other\"}";
  for (int i = 0; i < 2; i++) {
    const Exposition& e = after[i];
    EXPECT_EQ(e.value("memtrace_processes_exported"), 1) << i;
    EXPECT_EQ(e.value("memtrace_processes_over_cap"), 1) << i;
    EXPECT_TRUE(e.has(pseries("memtrace_heap_in_use_bytes", t.pid, "alloc_rounds"))) << i;
    EXPECT_EQ(e.value("memtrace_heap_in_use_bytes" + other), cs["in_use_bytes"].get<long>()) << i;
    EXPECT_EQ(e.value("memtrace_heap_in_use_blocks" + other), cs["in_use_blocks"].get<long>()) << i;
    EXPECT_EQ(e.value("memtrace_allocations_total" + other), cs["allocs"].get<long>()) << i;
    EXPECT_EQ(e.value("memtrace_frees_total" + other), cs["frees"].get<long>()) << i;
  }
  EXPECT_EQ(cs["allocs"].get<long>(), kRounds * t.per.allocs);  // the child's own calls: the rounds
  EXPECT_EQ(after[2].value("memtrace_processes_over_cap"), 0);
  EXPECT_FALSE(after[2].has("memtrace_heap_in_use_bytes" + other));
  EXPECT_TRUE(after[2].has(pseries("memtrace_heap_in_use_bytes", t.pid, "alloc_rounds")));
}

// Prometheus (Debian's /usr/bin/prometheus) on 127.0.0.1 with a 1 s scrape
// interval scrapes the tool; its query API answers with the target's
// in-use bytes.
TEST_F(Metrics, PrometheusScrapesAndAnswersAQuery) {
  if (access("/usr/bin/prometheus", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/prometheus (Debian prometheus)");
  Traced t;
  ASSERT_TRUE(t.start({}, {})) << t.err << t.out;
  ASSERT_TRUE(t.release_rounds()) << t.out << t.err;
  Exposition mine = parse_exposition(t.scrape());
  long want = mine.value(pseries("memtrace_heap_in_use_bytes", t.pid, "alloc_rounds"));
  ASSERT_GT(want, 0);

  char dir_template[] = "/tmp/metrics-prometheus-XXXXXX";
  ASSERT_TRUE(mkdtemp(dir_template));
  std::string dir = dir_template;
  uint16_t web = free_port();
  std::ofstream(dir + "/prometheus.yml") << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                                         << "scrape_configs:\n  - job_name: memtrace\n    static_configs:\n"
                                         << "      - targets: ['127.0.0.1:" << t.port << "']\n";
  pid_t prom = fork();
  if (prom == 0) {
    int log = open((dir + "/log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    dup2(log, 1);
    dup2(log, 2);
    std::string cfg = "--config.file=" + dir + "/prometheus.yml", db = "--storage.tsdb.path=" + dir + "/data",
                listen = "--web.listen-address=127.0.0.1:" + std::to_string(web);
    execl("/usr/bin/prometheus", "prometheus", cfg.c_str(), db.c_str(), listen.c_str(), "--log.level=warn",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_GT(prom, 0);
  std::string query = "/api/v1/query?query=memtrace_heap_in_use_bytes%7Bpid%3D%22" + std::to_string(t.pid) +
                      "%22%2Ccomm%3D%22alloc_rounds%22%7D";
  json answer;
  long got = -1;
  auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < 25s) {
    HttpReply r = http_get(web, query);
    if (r.status == 200) {
      answer = json::parse(r.body, nullptr, false);
      if (answer.is_object() && answer["status"] == "success" && !answer["data"]["result"].empty()) {
        got = std::stol(answer["data"]["result"][0]["value"][1].get<std::string>());
        break;
      }
    }
    std::this_thread::sleep_for(200ms);
  }
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  kill(prom, SIGTERM);
  waitpid(prom, nullptr, 0);
  std::string log = slurp(dir + "/log");
  shell_output("rm -rf '" + dir + "'");
  EXPECT_EQ(got, want) << "after " << took << " s: " << answer.dump() << "\nprometheus log:\n" << log;
  EXPECT_EQ(t.finish(), 0) << t.err;
  const json* p = find_proc(t.report, t.pid);
  ASSERT_TRUE(p);
  EXPECT_EQ((*p)["summary"]["in_use_bytes"].get<long>(), want);
}

TEST_F(Metrics, BadAddressIsOneLineAndNothingRuns) {
  int taken = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(bind(taken, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(taken, 1), 0);
  getsockname(taken, reinterpret_cast<sockaddr*>(&a), &len);
  std::string busy = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  struct Case {
    std::string address, says;
  } cases[] = {
      {":99999", "memtrace-bpf: --metrics ':99999': port 99999 is not 0-65535\n"},
      {busy, "memtrace-bpf: metrics address " + busy + ": Address already in use\n"},
      {"no-such-host.invalid:9464",
       "memtrace-bpf: metrics address no-such-host.invalid:9464: no-such-host.invalid is not an IP address or a "
       "name in /etc/hosts (memtrace-bpf does not ask DNS)\n"},
  };
  for (const auto& c : cases) {
    ToolRun r = run_argv({tool(), "--metrics", c.address, "--", "/bin/echo", "started"});
    EXPECT_EQ(r.code, 2) << c.address;
    EXPECT_EQ(r.err, c.says);
    EXPECT_EQ(r.out, "");  // nothing was started
  }
  close(taken);
}

}  // namespace
