// src/metrics without BPF: --metrics addresses, the exposition (cap, the
// `other` series, exited processes kept for two scrapes, escaping), and the
// HTTP server's answers and limits, through the exporter with a stand-in
// drain thread.
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

#include "metrics/exporter.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
#include "metrics/snapshot.h"
#include "scrape.h"
#include "shell.h"
#include "test_env.h"

using namespace memtrace;
using namespace memtrace::metrics;
using namespace memtrace::testing;
using namespace std::chrono_literals;

namespace {

TEST(ListenAddress, Parses) {
  auto a = parse_listen_address("127.0.0.1:9464");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 9464);
  a = parse_listen_address(":0");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "");
  EXPECT_EQ(a->port, 0);
  a = parse_listen_address("[::1]:80");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->port, 80);
  a = parse_listen_address("localhost:65535");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->port, 65535);
}

TEST(ListenAddress, RefusesWithOneLine) {
  for (const char* bad : {":99999", "9464", "", "::1:80", "[::1]80", "[::1", "host:", "host:12a", "host:123456",
                          "host:-1"}) {
    auto a = parse_listen_address(bad);
    ASSERT_FALSE(a) << bad;
    EXPECT_EQ(a.error().message.find('\n'), std::string::npos);
    EXPECT_NE(a.error().message.find(std::string("'") + bad + "'"), std::string::npos) << a.error().message;
  }
}

TEST(ListenAddress, BindErrorsNameTheAddress) {
  auto taken = HttpServer::listen({"127.0.0.1", 0});
  ASSERT_TRUE(taken) << taken.error().message;
  uint16_t port = std::stoi(taken.value()->url().substr(taken.value()->url().rfind(':') + 1));
  auto again = HttpServer::listen({"127.0.0.1", port});
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().message,
            "metrics address 127.0.0.1:" + std::to_string(port) + ": Address already in use");
  auto nohost = HttpServer::listen({"no-such-host.invalid", 9464});
  ASSERT_FALSE(nohost);
  EXPECT_EQ(nohost.error().message,
            "metrics address no-such-host.invalid:9464: no-such-host.invalid is not an IP address or a name in "
            "/etc/hosts (memtrace-bpf does not ask DNS)");
  auto local = HttpServer::listen({"localhost", 0});
  ASSERT_TRUE(local) << local.error().message;
}

TEST(ValidUtf8, ReplacesWhatIsNotUtf8) {
  EXPECT_EQ(valid_utf8("abc"), "abc");
  EXPECT_EQ(valid_utf8("caf\xc3\xa9"), "caf\xc3\xa9");
  EXPECT_EQ(valid_utf8("a\xffz"), "a\xEF\xBF\xBDz");
  EXPECT_EQ(valid_utf8("\xc0\xaf"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong '/'
  EXPECT_EQ(valid_utf8("\xed\xa0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
  EXPECT_EQ(valid_utf8("\xe2\x82"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // cut short
  EXPECT_EQ(valid_utf8("\xf0\x9f\x98\x80"), "\xf0\x9f\x98\x80");
}

ProcessSample proc(pid_t pid, const std::string& comm, uint64_t in_use, bool gone = false) {
  ProcessSample p;
  p.pid = pid;
  p.comm = comm;
  p.gone = gone;
  p.in_use_bytes = in_use;
  p.in_use_blocks = in_use / 10;
  p.allocs = in_use / 5;
  p.bytes_allocated = in_use * 3;
  p.mmap_program = 4096;
  return p;
}

std::string render(Selection& sel, const Snapshot& s) { return sel.render(s, 0s); }

TEST(Exposition, CapSumsTheRestIntoOther) {
  Selection sel({.max_processes = 2, .retain_scrapes = 2});
  Snapshot s;
  s.processes = {proc(10, "small", 100), proc(11, "big", 5000), proc(12, "mid", 700)};
  s.drops.dropped["ringbuf"] = 3;
  s.drops.stats["events"] = 42;
  s.drops.stats["ringbuf_peak_kb"] = 2;
  s.drops.stats["unwind_rows"] = 9;
  Exposition e = parse_exposition(render(sel, s));
  EXPECT_EQ(e.duplicates, 0);
  // The two with the most bytes in use have series; the third is `other`.
  EXPECT_EQ(e.value(series("memtrace_heap_in_use_bytes", 11, "big")), 5000);
  EXPECT_EQ(e.value(series("memtrace_heap_in_use_bytes", 12, "mid")), 700);
  EXPECT_FALSE(e.has(series("memtrace_heap_in_use_bytes", 10, "small")));
  EXPECT_EQ(e.value("memtrace_heap_in_use_bytes{pid=\"other\",comm=\"other\"}"), 100);
  EXPECT_EQ(e.value("memtrace_allocations_total{pid=\"other\",comm=\"other\"}"), 20);
  EXPECT_EQ(e.value("memtrace_mmap_bytes_total{pid=\"other\",comm=\"other\",by=\"program\"}"), 4096);
  EXPECT_FALSE(e.has("memtrace_heap_peak_in_use_bytes{pid=\"other\",comm=\"other\"}"));  // a sum of peaks means nothing
  EXPECT_EQ(e.value("memtrace_processes_exported"), 2);
  EXPECT_EQ(e.value("memtrace_processes_over_cap"), 1);
  EXPECT_EQ(e.value("memtrace_dropped_total{kind=\"ringbuf\"}"), 3);
  EXPECT_EQ(e.value("memtrace_events_total"), 42);
  EXPECT_EQ(e.value("memtrace_ringbuf_peak_bytes"), 2048);
  EXPECT_EQ(e.value("memtrace_stat{name=\"unwind_rows\"}"), 9);
  EXPECT_FALSE(e.has("memtrace_stat{name=\"events\"}"));
  EXPECT_FALSE(e.has(series("memtrace_page_faults_total", 11, "big")));  // no --faults

  // Slots stay with their processes while they live: `small` growing past
  // the others does not take one.
  s.processes[0].in_use_bytes = 90000;
  e = parse_exposition(render(sel, s));
  EXPECT_TRUE(e.has(series("memtrace_heap_in_use_bytes", 12, "mid")));
  EXPECT_EQ(e.value("memtrace_heap_in_use_bytes{pid=\"other\",comm=\"other\"}"), 90000);
}

TEST(Exposition, ExitedProcessesStayTwoScrapes) {
  Selection sel({.max_processes = 1, .retain_scrapes = 2});
  Snapshot s;
  s.processes = {proc(20, "first", 10), proc(21, "second", 5)};
  Exposition e = parse_exposition(render(sel, s));
  ASSERT_TRUE(e.has(series("memtrace_heap_in_use_bytes", 20, "first")));
  ASSERT_EQ(e.value("memtrace_processes_over_cap"), 1);
  s.processes[0].gone = true;  // exited with 10 bytes in use
  for (int scrape = 1; scrape <= 2; scrape++) {
    e = parse_exposition(render(sel, s));
    EXPECT_EQ(e.value(series("memtrace_heap_in_use_bytes", 20, "first")), 10) << scrape;
    EXPECT_EQ(e.value("memtrace_processes_over_cap"), 1) << scrape;
  }
  // Dropped: its slot goes to the process waiting in `other`.
  e = parse_exposition(render(sel, s));
  EXPECT_FALSE(e.has(series("memtrace_heap_in_use_bytes", 20, "first")));
  EXPECT_EQ(e.value(series("memtrace_heap_in_use_bytes", 21, "second")), 5);
  EXPECT_EQ(e.value("memtrace_processes_over_cap"), 0);
  EXPECT_FALSE(e.has("memtrace_heap_in_use_bytes{pid=\"other\",comm=\"other\"}"));
  // The pid comes back under the same name (reused): a live process again.
  s.processes[0].gone = false;
  s.processes[0].in_use_bytes = 1;
  e = parse_exposition(render(sel, s));
  EXPECT_EQ(e.value("memtrace_heap_in_use_bytes{pid=\"other\",comm=\"other\"}"), 1);
}

TEST(Exposition, LabelValuesAreEscapedAndFaultsShownWhenTraced) {
  Selection sel({});
  Snapshot s;
  s.faults = true;
  s.processes = {proc(30, "a\"b\\c\nd", 1)};
  s.processes[0].faults = 7;
  s.processes[0].pages_touched = 3;
  std::string text = render(sel, s);
  EXPECT_NE(text.find("memtrace_heap_in_use_bytes{pid=\"30\",comm=\"a\\\"b\\\\c\\nd\"} 1\n"), std::string::npos)
      << text;
  Exposition e = parse_exposition(text);
  EXPECT_EQ(e.value("memtrace_page_faults_total{pid=\"30\",comm=\"a\\\"b\\\\c\\nd\"}"), 7);
  EXPECT_EQ(e.value("memtrace_pages_touched_total{pid=\"30\",comm=\"a\\\"b\\\\c\\nd\"}"), 3);
}

TEST(Exposition, PromtoolAcceptsIt) {
  if (access("/usr/bin/promtool", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/promtool (Debian prometheus)");
  Selection sel({.max_processes = 1});
  Snapshot s;
  s.faults = true;
  s.processes = {proc(40, "one", 1), proc(41, "tw\"o", 2), proc(42, "caf\xc3\xa9", 3, true)};
  s.drops.dropped["ringbuf"] = 0;
  for (const char* k : {"events", "tool_rings_kb", "ringbuf_peak_kb", "tool_rss_kb", "attach_us"})
    s.drops.stats[k] = 1;
  std::string path = "/tmp/metrics-unit-" + std::to_string(getpid()) + ".txt";
  std::ofstream(path) << render(sel, s);
  std::string out = shell_output("/usr/bin/promtool check metrics < " + path + " 2>&1; echo rc=$?");
  unlink(path.c_str());
  EXPECT_NE(out.find("rc=0"), std::string::npos) << out;
}

// An exporter on 127.0.0.1 with a stand-in drain thread that answers
// wake_fd() with a snapshot holding one process whose in-use bytes count
// the snapshots taken.
struct Served {
  std::unique_ptr<Exporter> ex;
  uint16_t port = 0;
  std::atomic<bool> drain{true}, quit{false};
  std::atomic<int> taken{0};
  std::thread t;
  explicit Served(ExporterOptions o = {}) {
    auto e = Exporter::listen("127.0.0.1:0", o);
    if (!e) {
      ADD_FAILURE() << e.error().message;
      return;
    }
    ex = std::move(*e);
    std::string url = ex->url();  // http://127.0.0.1:PORT/metrics
    port = std::stoi(url.substr(url.rfind(':') + 1));
    ex->start();
    t = std::thread([this] {
      while (!quit) {
        pollfd p{ex->wake_fd(), POLLIN, 0};
        poll(&p, 1, 20);
        if (!drain) continue;
        ex->serve([this] {
          Snapshot s;
          s.processes = {proc(50, "target", ++taken)};
          s.taken = std::chrono::steady_clock::now();
          return s;
        });
      }
    });
  }
  ~Served() {
    quit = true;
    if (t.joinable()) t.join();
    if (ex) ex->stop();
  }
};

// A scrape, and how long it took.
HttpReply timed_scrape(uint16_t port, double* seconds) {
  auto t0 = std::chrono::steady_clock::now();
  HttpReply r = http_get(port, "/metrics");
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

TEST(Server, AnswersMetricsAndNothingElse) {
  Served s;
  ASSERT_TRUE(s.ex);
  HttpReply r = http_get(s.port, "/metrics");
  ASSERT_EQ(r.status, 200);
  Exposition e = parse_exposition(r.body);
  EXPECT_EQ(e.value(series("memtrace_heap_in_use_bytes", 50, "target")), 1);  // taken for this scrape
  r = http_get(s.port, "/metrics?x=1");
  EXPECT_EQ(parse_exposition(r.body).value(series("memtrace_heap_in_use_bytes", 50, "target")), 2);
  EXPECT_EQ(http_get(s.port, "/").status, 404);
  EXPECT_EQ(http_get(s.port, "/metricsx").status, 404);
  EXPECT_EQ(http_get(s.port, "", "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").status, 405);
  EXPECT_EQ(http_get(s.port, "", "GET /metrics\r\n\r\n").status, 400);
  r = http_get(s.port, "", "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "");
  // Content type of the text format.
  int fd = connect_local(s.port);
  std::string req = "GET /metrics HTTP/1.0\r\n\r\n";
  ASSERT_EQ(send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  char buf[4096];
  ssize_t n = recv(fd, buf, sizeof buf, MSG_WAITALL);
  close(fd);
  ASSERT_GT(n, 0);
  EXPECT_NE(std::string(buf, n).find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
}

TEST(Server, RefusesAnOversizedRequest) {
  Served s;
  ASSERT_TRUE(s.ex);
  std::string big = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(20000, 'a') + "\r\n\r\n";
  HttpReply r = http_get(s.port, "", big);
  EXPECT_EQ(r.status, 431);
  EXPECT_EQ(s.ex->http_stats().refused.load(), 1u);
  EXPECT_EQ(http_get(s.port, "/metrics").status, 200);  // and goes on
}

TEST(Server, ASilentClientHoldsItUpOnlyUntilItsTimeout) {
  ExporterOptions o;
  o.http.request_ms = 300;
  Served s(o);
  ASSERT_TRUE(s.ex);
  int silent = connect_local(s.port);  // connects, sends nothing
  ASSERT_GE(silent, 0);
  std::this_thread::sleep_for(50ms);
  double waited = 0;
  HttpReply r = timed_scrape(s.port, &waited);
  EXPECT_EQ(r.status, 200);
  EXPECT_GT(waited, 0.15);
  EXPECT_LT(waited, 2.0);
  char c;
  EXPECT_EQ(recv(silent, &c, 1, 0), 0);  // closed by the server, no answer
  close(silent);
  EXPECT_EQ(s.ex->http_stats().timeouts.load(), 1u);
}

TEST(Server, ABusyDrainThreadGetsTheLastSnapshot) {
  ExporterOptions o;
  o.fresh_wait_ms = 200;
  Served s(o);
  ASSERT_TRUE(s.ex);
  s.drain = false;  // never took one: nothing to show yet
  EXPECT_EQ(http_get(s.port, "/metrics").status, 503);
  s.drain = true;
  ASSERT_EQ(http_get(s.port, "/metrics").status, 200);
  s.drain = false;
  std::this_thread::sleep_for(100ms);
  double waited = 0;
  HttpReply r = timed_scrape(s.port, &waited);
  ASSERT_EQ(r.status, 200);
  EXPECT_GE(waited, 0.19);
  Exposition e = parse_exposition(r.body);
  EXPECT_EQ(e.value(series("memtrace_heap_in_use_bytes", 50, "target")), s.taken.load());
  double age = std::stod(e.samples["memtrace_snapshot_age_seconds"]);
  EXPECT_GE(age, 0.25);
}

TEST(Server, StopsWhileAClientIsMidRequest) {
  Served s;
  ASSERT_TRUE(s.ex);
  int slow = connect_local(s.port);
  ASSERT_EQ(send(slow, "GET /met", 8, 0), 8);
  std::this_thread::sleep_for(50ms);
  auto t0 = std::chrono::steady_clock::now();
  s.ex->stop();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.5);
  close(slow);
}

}  // namespace
