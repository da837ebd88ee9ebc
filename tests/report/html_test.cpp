// The HTML report (issue 19): tests/report/html_phases (which knows its
// phases, its leak and its temporaries) traced with --faults into r.html and
// r.json; the page's data must add up to the JSON's totals, and headless
// Chromium (html_check.js over the DevTools protocol) must show it: no
// console error, no request but the file itself, the leaking function in the
// flame graph, a click that zooms, values that switch, time ranges that
// filter. `replay` of the recording and --format html give the same data.
// And html_data on hand-made models: the cap on stacks, '<' in names.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <numeric>
#include <sstream>

#include "harness.h"
#include "heap/heap_model.h"
#include "html_check.h"
#include "report/html.h"
#include "slurp.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

// The JSON the page draws from (write_html puts it in #memtrace-data).
json page_data(const std::string& html) {
  const std::string open = "<script type=\"application/json\" id=\"memtrace-data\">";
  size_t a = html.find(open);
  if (a == std::string::npos) return nullptr;
  a += open.size();
  size_t b = html.find("</script>", a);
  if (b == std::string::npos) return nullptr;
  return json::parse(html.substr(a, b - a), nullptr, false);
}

uint64_t sum(const json& column) {
  uint64_t s = 0;
  for (const auto& v : column) s += v.get<uint64_t>();
  return s;
}

const json* image_of(const json& data, int pid) {
  for (const auto& im : data["images"])
    if (im["pid"] == pid) return &im;
  return nullptr;
}

constexpr uint64_t kEarly = 64 * 16384, kLate = 48 * 32768, kLeak = 100 * 100;

struct Phases {
  uint64_t early_start = 0, early_end = 0, late_start = 0;
};
Phases parse_phases(const std::string& out) {
  Phases p;
  std::istringstream in(out);
  std::string word;
  while (in >> word) {
    if (word == "early") in >> p.early_start >> p.early_end;
    if (word == "late") in >> p.late_start;
  }
  return p;
}

// What replay must give again: every image's data with its stacks named by
// their frames (not indexes), without what page faults add (a recording
// replays without them), nor when it was written.
json comparable(const json& d) {
  if (!d.is_object()) return nullptr;
  auto frame = [&](const json& i) {
    const json& f = d["frames"][i.get<size_t>()];
    auto str = [&](const json& s) { return s.get<int>() < 0 ? std::string() : d["strings"][s.get<size_t>()].get<std::string>(); };
    return str(f[0]) + "@" + str(f[1]) + ":" + std::to_string(f[2].get<int>()) + " " + str(f[3]) + (f[4] == 1 ? " inlined" : "");
  };
  json images = json::array();
  for (const auto& im : d["images"]) {
    json c = im;
    c.erase("stacks");
    c.erase("values");
    c.erase("spans");
    c.erase("stacks_total");
    c.erase("kept_stacks");
    c["summary"].erase("pages_first_touched");
    if (c["timeline"].is_object()) c["timeline"].erase("touched_pages");
    json stacks = json::object();
    for (size_t i = 0; i < im["stacks"].size(); i++) {
      json row = json::object();
      bool any = false;
      for (const auto& [k, col] : im["values"].items())
        if (k != "pages") {
          row[k] = col[i];
          any = any || col[i] != 0;
        }
      if (!any) continue;  // a stack only page faults named
      if (im["spans"].is_object()) row["spans"] = im["spans"]["by_stack"][i];
      std::string name;
      for (const auto& f : im["stacks"][i]) name += frame(f) + ";";
      stacks[name] = row;
    }
    c["stacks"] = stacks;
    if (im["spans"].is_object()) c["span_buckets"] = {im["spans"]["offset_ns"], im["spans"]["bucket_ns"]};
    images.push_back(c);
  }
  return images;
}

class HtmlReport : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    if (access(CHROMIUM_BIN, X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no headless Chromium (Debian chromium)");
    if (access(NODE_BIN, X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no node");
    dir_ = "/tmp/memtrace-html-" + std::to_string(getpid());
    ASSERT_EQ(system(("rm -rf " + dir_ + " && mkdir -p " + dir_).c_str()), 0);
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) (void)!system(("rm -rf " + dir_).c_str());
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

TEST_F(HtmlReport, PageOfATraceInChromiumAndFromReplay) {
  ToolRun r = run_argv({tool(), "--faults", "--record", path("run.mtr"), "-o", path("r.html"), "-o", path("r.json"),
                        "--", target("html_phases")});
  ASSERT_EQ(r.code, 0) << r.err;
  Phases ph = parse_phases(r.out);
  ASSERT_GT(ph.late_start, ph.early_end) << r.out;
  json rep = json::parse(slurp(path("r.json")), nullptr, false);
  const json* jp = find_comm(rep, "html_phases");
  ASSERT_NE(jp, nullptr) << rep.dump();
  const json& s = (*jp)["summary"];
  std::string html = slurp(path("r.html"));
  EXPECT_EQ(html.rfind("<!doctype html>", 0), 0u) << html.substr(0, 200);
  json data = page_data(html);
  ASSERT_TRUE(data.is_object());
  const json* im = image_of(data, (*jp)["pid"].get<int>());
  ASSERT_NE(im, nullptr) << data.dump().substr(0, 2000);

  // The page's columns add up to the JSON report's totals.
  const json& v = (*im)["values"];
  EXPECT_EQ(sum(v["live_bytes"]), s["in_use_bytes"].get<uint64_t>());
  EXPECT_EQ(sum(v["live_blocks"]), s["in_use_blocks"].get<uint64_t>());
  EXPECT_EQ(sum(v["alloc_bytes"]), s["bytes_allocated"].get<uint64_t>());
  EXPECT_EQ(sum(v["alloc_count"]), s["allocs"].get<uint64_t>());
  EXPECT_EQ(sum(v["peak_bytes"]), s["peak_in_use_bytes"].get<uint64_t>());
  EXPECT_EQ(sum(v["temporary"]), (*im)["summary"]["temporary_allocs"].get<uint64_t>());
  EXPECT_GE(sum(v["temporary"]), 1000u);
  EXPECT_GT(sum(v["pages"]), 0u);
  EXPECT_EQ((*im)["other_stacks"], 0);
  ASSERT_TRUE((*im)["timeline"].is_object());
  ASSERT_TRUE((*im)["spans"].is_object());

  // In Chromium: early range = the middle of the early phase, late = of the late one.
  uint64_t margin = 60'000'000;
  std::string early = std::to_string(ph.early_start + margin) + ":" + std::to_string(ph.early_end - margin);
  std::string late = std::to_string(ph.late_start + margin) + ":" + std::to_string(ph.late_start + 190'000'000);
  ToolRun c = run_argv({NODE_BIN, CHECK_JS, "--chromium", CHROMIUM_BIN, "--page", path("r.html"), "--names",
                        "parse_header,early_buffers,late_buffers,scratch", "--click", "parse_header", "--range", early,
                        "--range", late});
  ASSERT_EQ(c.code, 0) << c.out << c.err;
  json o = json::parse(c.out, nullptr, false);
  ASSERT_TRUE(o.is_object()) << c.out;
  SCOPED_TRACE(o.dump(1).substr(0, 3000));
  expect_page_used(o, path("r.html"));  // no error, nothing fetched, a click zooms, a search
  EXPECT_NE(o["drawn_names"].dump().find("\"parse_header\""), std::string::npos);

  // Live bytes at the end: the leak and the late buffers.
  const json& init = o["initial"];
  EXPECT_EQ(init["total"]["kind"], "live_bytes");
  EXPECT_EQ(init["total"]["value"], s["in_use_bytes"]);
  EXPECT_EQ(init["values"]["parse_header"], kLeak);
  EXPECT_EQ(init["values"]["late_buffers"], kLate);
  EXPECT_EQ(init["values"]["early_buffers"], 0);

  // Every value switches the graph.
  const json& k = o["kinds"];
  for (const char* kind : {"live_bytes", "peak_bytes", "alloc_bytes", "alloc_count", "temporary", "pages"})
    EXPECT_TRUE(k.contains(kind)) << kind;
  EXPECT_EQ(k["alloc_count"]["total"]["value"], s["allocs"]);
  EXPECT_EQ(k["alloc_count"]["values"]["scratch"], 1000);
  EXPECT_EQ(k["alloc_count"]["values"]["parse_header"], 100);
  EXPECT_EQ(k["alloc_count"]["values"]["early_buffers"], 64);
  EXPECT_EQ(k["alloc_count"]["values"]["late_buffers"], 48);
  EXPECT_EQ(k["alloc_bytes"]["values"]["early_buffers"], kEarly);
  EXPECT_EQ(k["peak_bytes"]["total"]["value"], s["peak_in_use_bytes"]);
  EXPECT_EQ(k["peak_bytes"]["values"]["late_buffers"], kLate);
  EXPECT_EQ(k["peak_bytes"]["values"]["early_buffers"], 0);
  EXPECT_EQ(k["peak_bytes"]["values"]["parse_header"], kLeak);
  EXPECT_EQ(k["temporary"]["values"]["scratch"], 1000);
  EXPECT_EQ(k["temporary"]["values"]["parse_header"], 0);
  // Pages first touched in blocks of late_buffers: the JSON's fault site of that stack.
  uint64_t late_pages = 0;
  for (const auto& site : (*jp)["faults"]["by_stack"])
    if (!site["stack"].empty() && site["stack"][0]["function"] == "late_buffers") late_pages += site["pages"].get<uint64_t>();
  EXPECT_GT(late_pages, 0u);
  EXPECT_LE(late_pages, 48u * 9);  // 48 blocks of 8 pages
  EXPECT_EQ(k["pages"]["values"]["late_buffers"], late_pages);
  EXPECT_EQ(k["pages"]["total"]["value"], sum(v["pages"]));
  EXPECT_NE(k["alloc_count"]["total"]["value"], k["live_bytes"]["total"]["value"]);

  // Time ranges: the allocations live in them.
  ASSERT_EQ(o["ranges"].size(), 2u);
  const json& re = o["ranges"][0];
  const json& rl = o["ranges"][1];
  EXPECT_EQ(re["values"]["early_buffers"], kEarly);
  EXPECT_EQ(re["values"]["late_buffers"], 0);
  EXPECT_EQ(re["values"]["parse_header"], kLeak);
  EXPECT_EQ(re["values"]["scratch"], 0);
  EXPECT_EQ(rl["values"]["early_buffers"], 0);
  EXPECT_EQ(rl["values"]["late_buffers"], kLate);
  EXPECT_EQ(rl["values"]["parse_header"], kLeak);
  EXPECT_NE(re["total"]["value"], init["total"]["value"]);
  EXPECT_NE(re["total"]["value"], rl["total"]["value"]);
  EXPECT_NE(re["range"].get<std::string>().find("range "), std::string::npos);
  EXPECT_EQ(o["after_ranges"]["total"]["value"], init["total"]["value"]);  // cleared

  // replay: the same data; --format html names the format of any file.
  ToolRun p = run_argv({tool(), "replay", path("run.mtr"), "-o", path("replay.html")});
  ASSERT_EQ(p.code, 0) << p.err;
  ToolRun f = run_argv({tool(), "replay", path("run.mtr"), "--format", "html", "-o", path("replay.page")});
  ASSERT_EQ(f.code, 0) << f.err;
  json live = comparable(data);
  json replayed = comparable(page_data(slurp(path("replay.html"))));
  EXPECT_TRUE(live == replayed) << json::diff(live, replayed).dump(1).substr(0, 4000);
  EXPECT_TRUE(live == comparable(page_data(slurp(path("replay.page")))));
  EXPECT_EQ(live[0]["stacks"].size(), 5u) << live.dump(1).substr(0, 3000);  // html_phases' five
}

// A hand-made model: 300 stacks, 100 kept whole, the other 200 folded under
// main, the caller they share; names with '<' stay in the data.
TEST(HtmlData, CapFoldsTheRestAndNamesAreSafe) {
  memtrace::heap::HeapModel m;
  for (uint64_t id = 1; id <= 300; id++) {
    mt_stack st{};
    st.h.kind = MT_EV_STACK;
    st.h.pid = 10;
    st.stack_id = id;
    st.nr = 2;
    st.ips[0] = 0x400000 + id * 16;
    st.ips[1] = 0x500000;  // main
    m.apply(&st, sizeof st);
    mt_event e{};
    e.h.kind = MT_EV_ALLOC;
    e.h.pid = 10;
    e.h.tid = 10;
    e.h.ts = 1000 + id;
    e.role = MT_ROLE_MALLOC;
    e.stack_id = id;
    e.addr = 0x10000 * id;
    e.size = id;  // stack id i holds i bytes
    m.apply(&e, sizeof e);
  }
  m.process(10).comm = "</script><b>";
  memtrace::report::Resolver r = [](const memtrace::heap::Process&, uint64_t addr, const memtrace::heap::Loc*, bool) {
    memtrace::report::FrameOut f;
    f.address = addr;
    f.function = addr == 0x500000 ? "main" : "fn<" + std::to_string((addr - 0x400000) / 16) + ">";
    f.module = "/bin/t";
    return std::vector<memtrace::report::FrameOut>{f};
  };
  memtrace::report::Options o;
  memtrace::report::HtmlOptions ho;
  ho.max_stacks = 100;
  json d = memtrace::report::html_data(m, r, o, ho);
  ASSERT_EQ(d["images"].size(), 1u);
  const json& im = d["images"][0];
  EXPECT_EQ(im["stacks_total"], 300);
  EXPECT_EQ(im["other_stacks"], 200);
  ASSERT_EQ(im["stacks"].size(), 101u);
  EXPECT_EQ(sum(im["values"]["live_bytes"]), 300u * 301 / 2);
  EXPECT_EQ(sum(im["values"]["alloc_count"]), 300u);
  // The largest first: stack 300 (300 bytes) leads, stacks 1..200 are folded.
  EXPECT_EQ(im["values"]["live_bytes"][0], 300);
  EXPECT_EQ(im["values"]["live_bytes"][100], 200u * 201 / 2);
  const json& strings = d["strings"];
  auto name = [&](const json& stack) { return strings[d["frames"][stack.back().get<int>()][0].get<int>()]; };
  EXPECT_EQ(name(im["stacks"][0]), "fn<300>");
  EXPECT_EQ(im["kept_stacks"], 100);
  EXPECT_EQ(name(im["stacks"][100]), "(200 other stacks)");
  ASSERT_EQ(im["stacks"][100].size(), 2u);  // main, then the fold
  EXPECT_EQ(strings[d["frames"][im["stacks"][100][0].get<int>()][0].get<int>()], "main");

  std::ostringstream page;
  ASSERT_TRUE(memtrace::report::write_html(page, m, r, o, ho));
  std::string html = page.str();
  json back = page_data(html);
  ASSERT_TRUE(back.is_object());
  EXPECT_EQ(back["images"][0]["comm"], "</script><b>");
  EXPECT_EQ(html.find("</script><b>"), std::string::npos);  // written \u003c/script>
  EXPECT_EQ(html.find("<script src"), std::string::npos);   // nothing to fetch
  EXPECT_EQ(html.find("<link"), std::string::npos);
}

}  // namespace

namespace {

// The diff page's data from hand-made sides: 30 stacks of one program, fn3
// grew by 1000 bytes in use and fn30's 300 were freed; with 10 kept whole
// (both among them: the largest changes), the other 20 are added up in one
// frame, every column's A and B sums stay exact, and each section's row
// names its stack among the page's.
TEST(HtmlData, DiffKeepsTheLargestChangesWholeAndAddsUpTheRest) {
  using namespace memtrace::report;
  DiffSide a, b;
  a.name = "a.mtr";
  b.name = "b.mtr";
  int64_t a_live = 0;
  for (int i = 1; i <= 30; i++) {
    FrameOut f;
    f.function = "fn" + std::to_string(i);
    f.module = "/bin/t";
    f.file = "t.c";
    f.line = i;
    DiffSide::Stack s;
    s.frames = {f};
    s.c = {i * 10, i, i, i * 10};  // live bytes and blocks, allocations and their bytes
    a_live += s.c.live_bytes;
    a.groups["t"].stacks[f.function] = s;
    if (i == 3) s.c.live_bytes += 1000, s.c.live_blocks += 1;
    if (i == 30) s.c.live_bytes = s.c.live_blocks = 0;
    b.groups["t"].stacks[f.function] = s;
  }
  Diff d = diff_sides(a, b, DiffMatch::Line, 10, true);
  HtmlOptions ho;
  ho.max_stacks = 10;
  json j = diff_html_data(d, ho);
  EXPECT_EQ(j["format"], "memtrace-bpf diff html");
  ASSERT_EQ(j["groups"].size(), 1u);
  const json& g = j["groups"][0];
  EXPECT_EQ(g["label"], "t");
  EXPECT_EQ(g["stacks_total"], 30);
  EXPECT_EQ(g["kept_stacks"], 10);
  EXPECT_EQ(g["other_stacks"], 20);
  ASSERT_EQ(g["stacks"].size(), 11u);
  EXPECT_EQ(sum(g["values"]["live_bytes"]["a"]), static_cast<uint64_t>(a_live));
  EXPECT_EQ(sum(g["values"]["live_bytes"]["b"]), static_cast<uint64_t>(a_live + 1000 - 300));
  EXPECT_EQ(sum(g["values"]["alloc_count"]["a"]), 30u * 31 / 2);
  EXPECT_EQ(sum(g["values"]["alloc_count"]["b"]), 30u * 31 / 2);
  auto name = [&](const json& stack) {
    return j["strings"][j["frames"][stack.back().get<size_t>()][0].get<size_t>()].get<std::string>();
  };
  EXPECT_EQ(name(g["stacks"][10]), "(20 other stacks)");
  ASSERT_EQ(g["grew"]["stacks"].size(), 1u);
  EXPECT_EQ(g["grew"]["stacks"][0]["delta"]["live_bytes"], 1000);
  EXPECT_EQ(name(g["stacks"][g["grew"]["stacks"][0]["stack"].get<size_t>()]), "fn3");
  ASSERT_EQ(g["shrank"]["stacks"].size(), 1u);
  EXPECT_EQ(name(g["stacks"][g["shrank"]["stacks"][0]["stack"].get<size_t>()]), "fn30");
  EXPECT_EQ(g["delta"]["in_use_bytes"], 0);  // the sides' totals: none given
}

}  // namespace
