// --inject -c over an exec storm (issue 34's daemon): each exec is injected
// between turns of the run loop, not inside the lifecycle ring's callback,
// so that /metrics (and --pprof-dir, the live view, Ctrl-C) are served
// while execs wait their turn. Before: at 10 execs a second the loop never
// left the callback (bench/soak: /metrics' snapshot as old as the run, no
// --pprof-dir file in 212 s).
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "test_env.h"
#include "../loader/harness.h"
#include "../metrics/scrape.h"
#include "inject_util.h"

using json = nlohmann::json;
using namespace memtrace::testing;  // NOLINT(google-build-using-namespace)

// 16 processes exec'd at once, each stopped at its exec until its turn
// (~70 ms of ptrace work each): scrapes sent back to back meanwhile are
// answered with execs still waiting (the queue's length is a STATS counter,
// memtrace_stat{name="inject_queue_waiting"}); every process is injected,
// the differences of their counts exact (10, 20, ... 160 rounds).
TEST(Inject, ExecStormIsInjectedBetweenScrapes) {
  MEMTRACE_REQUIRE_ROOT();
  const int kProcs = 16;
  std::string rep = tmpfile("storm");
  uint16_t port = free_port();
  std::string addr = "127.0.0.1:" + std::to_string(port);
  Child m = spawn({MEMTRACE_BIN, "--format", "json", "-o", rep, "--inject", "-c", "inject_target", "--metrics", addr});
  close(m.in);
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  ASSERT_EQ(http_get(port, "/metrics").status, 200);
  const std::string waiting = "memtrace_stat{name=\"inject_queue_waiting\"}";
  std::atomic<bool> done{false};
  std::atomic<int> scrapes{0}, with_waiting{0}, max_waiting{0};
  std::thread scraper([&] {
    while (!done) {
      HttpReply r = http_get(port, "/metrics");
      if (r.status != 200) continue;
      scrapes++;
      auto e = parse_exposition(r.body);
      auto it = e.samples.find(waiting);
      int w = it == e.samples.end() ? 0 : std::stoi(it->second);
      if (w > 0) with_waiting++;
      if (w > max_waiting) max_waiting = w;
    }
  });
  std::vector<Child> storm;
  for (int i = 0; i < kProcs; i++) {
    storm.push_back(spawn({std::string(TARGET_DIR) + "/inject_target", std::to_string(10 * (i + 1))}));
    close(storm.back().in);
  }
  std::vector<std::string> outs;
  for (auto& c : storm) {
    outs.push_back(read_all(c.out));
    EXPECT_EQ(exit_within(c.pid, 60000), 0) << outs.back();
  }
  done = true;
  scraper.join();
  kill(m.pid, SIGINT);
  EXPECT_EQ(exit_within(m.pid, 30000), 0) << merr;
  merr += read_all(m.err);
  std::cerr << scrapes << " scrapes during the storm, " << with_waiting << " with execs waiting (at most " << max_waiting
            << ")\n";
  EXPECT_GT(with_waiting.load(), 0) << scrapes << " scrapes during the storm, none answered while execs waited";
  EXPECT_GT(max_waiting.load(), 1);
  EXPECT_EQ(count_of(merr, "uprobes instead"), 0u) << merr;
  json j = json::parse(slurp_file(rep), nullptr, false);
  unlink(rep.c_str());
  ASSERT_TRUE(j.is_object()) << merr;
  const json* p0 = find_proc(j, storm[0].pid);
  ASSERT_TRUE(p0) << storm[0].pid << " missing: " << merr;
  for (int i = 1; i < kProcs; i++) {
    const json* p = find_proc(j, storm[i].pid);
    ASSERT_TRUE(p) << storm[i].pid << " missing: " << merr;
    expect_rounds_exact(*p, *p0, parse_expect(outs[i]), parse_expect(outs[0]));
  }
  EXPECT_EQ(j["stats"].value("inject_execs_queued", 0), kProcs) << j["stats"].dump();
  EXPECT_EQ(j["stats"].value("inject_queue_waiting", -1), 0) << j["stats"].dump();
  EXPECT_EQ(j["stats"].value("inject_queue_ended_waiting", -1), 0) << j["stats"].dump();
  EXPECT_EQ(j["dropped"].value("inject_queue_left_at_end", -1), 0) << j["dropped"].dump();
  expect_nothing_dropped(j);
}
