// BPF stacks vs gdb: for each proof case of issue 5 the stack that
// mt_capture_stack (bpf/stack.bpf.h) takes at the malloc uprobe must name
// the same functions, in the same order, as gdb's `bt` at a breakpoint on
// the same malloc call; complete stacks must reach _start / clone3 without
// the truncated flag, and the 200-deep recursion must be cut at
// MT_MAX_FRAMES (128) and marked truncated.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "test_env.h"
#include "shell.h"

using namespace memtrace::unwind;

namespace {

constexpr uint64_t kMark = 123457;


// "operator new(unsigned long)" -> "operator new"; "Holder<char>::make" stays.
std::string norm(std::string s) {
  auto p = s.find('(');
  if (p != std::string::npos && p > 0) s.resize(p);
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

struct GdbFrame {
  uint64_t pc;
  std::string name;
};

// gdb's real frames (NORMAL_FRAME: not the inline frames it adds from
// DWARF, nor the TAILCALL_FRAMEs it synthesises from call-site info -- qsort
// tail-jumps to qsort_r, so no unwinder can see a qsort frame) at `break malloc if $rdi == kMark`, past
// main, frame #0 (malloc itself) dropped: the BPF stack starts at malloc's
// caller. gdb runs the program without ASLR, as the traced run does.
std::vector<GdbFrame> gdb_bt(const std::vector<std::string>& argv) {
  char script[] = "/tmp/unw-gdb-XXXXXX";
  int fd = mkstemp(script);
  std::string py =
      "set debuginfod enabled off\nset breakpoint pending on\nset pagination off\n"
      "set backtrace past-main on\nset backtrace limit 400\n"
      "break malloc if $rdi == " + std::to_string(kMark) + "\nrun\n"
      "python\nf = gdb.newest_frame()\nwhile f is not None:\n"
      "    if f.type() == gdb.NORMAL_FRAME:\n        print('FRAME %x %s' % (f.pc(), f.name()))\n"
      "    f = f.older()\nend\n";
  if (write(fd, py.data(), py.size()) != ssize_t(py.size())) ADD_FAILURE() << "write gdb script";
  close(fd);
  std::string cmd = "DEBUGINFOD_URLS= gdb -batch -nx -x " + std::string(script) + " --args";
  for (auto& a : argv) cmd += " '" + a + "'";
  std::string out = memtrace::testing::shell_output(cmd + " 2>&1");
  unlink(script);
  std::vector<GdbFrame> frames;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("FRAME ", 0) != 0) continue;
    std::istringstream ls(line.substr(6));
    GdbFrame f;
    ls >> std::hex >> f.pc;
    std::getline(ls >> std::ws, f.name);
    frames.push_back(f);
  }
  if (!frames.empty()) frames.erase(frames.begin());
  if (frames.empty()) ADD_FAILURE() << "gdb printed no frames:\n" << out;
  return frames;
}

// gcc clones: "msort_with_tmp.part.0" is gdb's "msort_with_tmp"; a
// demangled template function carries its return type ("Holder<char>*
// build<char>"), gdb's name does not.
std::string base_name(std::string s) {
  s = norm(s);
  int depth = 0;
  size_t last = std::string::npos;
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] == '<') depth++;
    else if (s[i] == '>') depth--;
    else if (s[i] == ' ' && depth == 0) last = i;
  }
  if (last != std::string::npos && s.compare(0, 9, "operator ") != 0) s = s.substr(last + 1);
  auto p = s.find('.');
  if (p != std::string::npos && p > 0) s.resize(p);
  return s;
}

struct Case {
  std::vector<std::string> argv;
  bool thread = false;
  bool truncated = false;  // expected cut at MT_MAX_FRAMES
  bool publish = true;     // false: harness::Options::publish (rows through the VMAs)
};

void check(const Case& c) {
  MEMTRACE_REQUIRE_ROOT();
  harness::Options opt;
  opt.mark_size = kMark;
  opt.no_aslr = true;
  opt.publish = c.publish;
  auto run = harness::trace(c.argv, opt);
  ASSERT_TRUE(run.ok()) << run.error().message;
  EXPECT_TRUE(run->table_errors.empty()) << run->table_errors;
  ASSERT_EQ(run->stacks.size(), 1u) << "one marked malloc, one stack";
  const harness::Stack& s = run->stacks[0];
  harness::Symbolizer sym(run->maps);
  std::vector<std::string> ours;
  std::string printed;
  for (auto ip : s.ips) {
    ours.push_back(norm(sym.name(ip)));
    char b[64];
    std::snprintf(b, sizeof b, "%#lx ", (unsigned long)ip);
    printed += b + ours.back() + "\n";
  }
  std::vector<GdbFrame> gdb = gdb_bt(c.argv);
  std::string gdb_printed;
  for (auto& g : gdb) {
    char b[64];
    std::snprintf(b, sizeof b, "%#lx ", (unsigned long)g.pc);
    gdb_printed += b + g.name + "\n";
  }
  SCOPED_TRACE("BPF stack:\n" + printed + "gdb frames (from #1):\n" + gdb_printed);
  ASSERT_FALSE(gdb.empty());
  size_t n = std::min(gdb.size(), ours.size());
  if (c.truncated) {
    EXPECT_EQ(ours.size(), size_t(MT_MAX_FRAMES));
    EXPECT_TRUE(s.flags & MT_F_STACK_TRUNCATED);
    EXPECT_GT(gdb.size(), size_t(MT_MAX_FRAMES));
  } else {
    EXPECT_EQ(ours.size(), gdb.size());
    EXPECT_FALSE(s.flags & MT_F_STACK_TRUNCATED);
    EXPECT_EQ(run->counters[MT_UC_END_OUTERMOST], 1u) << "stack must end at an outermost frame";
    std::string outermost = c.thread ? "clone3" : "_start";
    bool found = false;
    for (auto& a : sym.aliases(s.ips.back())) found |= a == outermost || a == "__" + outermost;
    EXPECT_TRUE(found) << "outermost frame " << ours.back() << ", want " << outermost;
  }
  if (!c.publish) {
    EXPECT_GT(run->counters[MT_UC_ROWS_VMA], 0u) << "rows found through the VMAs";
  }
  for (size_t i = 0; i < n; i++) {
    EXPECT_EQ(s.ips[i], gdb[i].pc) << "frame " << i << " return address";
    bool same = false;
    for (auto& a : sym.aliases(s.ips[i])) same |= base_name(a) == base_name(gdb[i].name);
    EXPECT_TRUE(same) << "frame " << i << ": ours " << ours[i] << ", gdb " << gdb[i].name;
  }
  std::printf("%s %s: %zu frames, gdb %zu frames, %zu compared; frames by CFI %lu, by FP %lu\n",
              c.argv[0].c_str(), c.argv.size() > 1 ? c.argv[1].c_str() : "", ours.size(), gdb.size(),
              n, (unsigned long)run->counters[MT_UC_FRAMES_CFI], (unsigned long)run->counters[MT_UC_FRAMES_FP]);
}

const std::string kTarget = UNW_DIR "/unwind_target";

}  // namespace

TEST(UnwindBpf, OmitFramePointerChain) { check({{kTarget, "chain"}}); }
TEST(UnwindBpf, QsortCallback) { check({{kTarget, "qsort"}}); }
TEST(UnwindBpf, SharedLibraryWithoutFramePointers) { check({{kTarget, "shlib"}}); }
TEST(UnwindBpf, CxxOperatorNewInTemplate) { check({{UNW_DIR "/cxx_target"}}); }
TEST(UnwindBpf, Thread) { check({{kTarget, "thread"}, true}); }
TEST(UnwindBpf, Recursion200Truncated) { check({{kTarget, "recurse"}, false, true}); }
// Deeper than the old 64-frame limit, within MT_MAX_FRAMES: complete, as gdb.
TEST(UnwindBpf, Recursion100Complete) { check({{kTarget, "recurse", "100"}}); }

// A process whose mappings the loader has not published yet (system-wide, a
// new process allocates before the loader has read its maps; a build's
// short processes often exit before): the files' rows are loaded (for other
// processes), and the walk finds them through the kernel's VMA of each pc
// and unwind_files. The same stacks as gdb's, through a library and the
// program without frame pointers.
TEST(UnwindBpf, UnpublishedProcessUnwindsThroughItsVmas) {
  check({{kTarget, "chain"}, false, false, false});
  check({{kTarget, "shlib"}, false, false, false});
  check({{UNW_DIR "/cxx_target"}, false, false, false});
}

// ... and without unwind_files the same walk has no rows: the frame-pointer
// fallback stops in the first function without a frame pointer.
TEST(UnwindBpf, UnpublishedProcessWithoutTheFilesIndexIsCut) {
  MEMTRACE_REQUIRE_ROOT();
  harness::Options opt;
  opt.mark_size = kMark;
  opt.publish = false;
  opt.files_index = false;
  auto run = harness::trace({kTarget, "chain"}, opt);
  ASSERT_TRUE(run.ok()) << run.error().message;
  ASSERT_EQ(run->stacks.size(), 1u);
  EXPECT_EQ(run->counters[MT_UC_ROWS_VMA], 0u);
  EXPECT_EQ(run->counters[MT_UC_END_OUTERMOST], 0u);
  EXPECT_LT(run->stacks[0].ips.size(), 5u);
}

// The limit is exact: a stack of MT_MAX_FRAMES frames is complete, one frame
// more is cut there and counted (MT_UC_TRUNC_DEPTH, MT_F_STACK_TRUNCATED).
TEST(UnwindBpf, StackOfExactlyTheFrameLimitIsCompleteOneMoreIsCut) {
  MEMTRACE_REQUIRE_ROOT();
  harness::Options opt;
  opt.mark_size = kMark;
  auto one = [&](int depth) {
    auto run = harness::trace({kTarget, "recurse", std::to_string(depth)}, opt);
    EXPECT_TRUE(run.ok()) << run.error().message;
    EXPECT_EQ(run.ok() ? run->stacks.size() : 0, 1u);
    return run;
  };
  auto r100 = one(100);
  ASSERT_TRUE(r100.ok() && r100->stacks.size() == 1);
  const int frames100 = int(r100->stacks[0].ips.size());  // recurse's 101 frames and main's callers
  ASSERT_LT(frames100, MT_MAX_FRAMES);
  const int exact = 100 + MT_MAX_FRAMES - frames100;
  auto at = one(exact);
  ASSERT_TRUE(at.ok() && at->stacks.size() == 1);
  EXPECT_EQ(at->stacks[0].ips.size(), size_t(MT_MAX_FRAMES));
  EXPECT_FALSE(at->stacks[0].flags & MT_F_STACK_TRUNCATED);
  EXPECT_EQ(at->counters[MT_UC_END_OUTERMOST], 1u);
  EXPECT_EQ(at->counters[MT_UC_TRUNC_DEPTH], 0u);
  auto past = one(exact + 1);
  ASSERT_TRUE(past.ok() && past->stacks.size() == 1);
  EXPECT_EQ(past->stacks[0].ips.size(), size_t(MT_MAX_FRAMES));
  EXPECT_TRUE(past->stacks[0].flags & MT_F_STACK_TRUNCATED);
  EXPECT_EQ(past->counters[MT_UC_END_OUTERMOST], 0u);
  EXPECT_EQ(past->counters[MT_UC_TRUNC_DEPTH], 1u);
  std::printf("frame limit %d: recursion %d complete, %d cut\n", MT_MAX_FRAMES, exact, exact + 1);
}

// A stack deeper than the old limit is kept by the walk memo too (one word
// per frame at least: MT_MEMO_WORDS) and replayed exactly.
TEST(UnwindBpf, WalkMemoReplaysDeepStacks) {
  MEMTRACE_REQUIRE_ROOT();
  harness::Options opt;
  opt.mark_size = kMark;
  auto run = harness::trace({kTarget, "recurse", "100", "50"}, opt);
  ASSERT_TRUE(run.ok()) << run.error().message;
  ASSERT_EQ(run->stacks.size(), 1u) << "one path, one stack";
  EXPECT_EQ(run->stacks[0].count, 50u);
  EXPECT_GT(run->stacks[0].ips.size(), 100u);
  EXPECT_FALSE(run->stacks[0].flags & MT_F_STACK_TRUNCATED);
  EXPECT_EQ(run->counters[MT_UC_STACKS], 50u);
  EXPECT_EQ(run->counters[MT_UC_END_OUTERMOST], 50u);
  EXPECT_GE(run->counters[MT_UC_MEMO_HITS], 48u) << "deep stacks are not replayed";
}

// The walk memo (bpf/unwind.bpf.h) replays a stack when the registers, the
// first frame and every stack word the last walk from there read are the
// same. m_a and m_b reach malloc at the same rsp through the same first
// frame and differ only further up; the chain path's rsp moves with an
// alloca and its frames do not (c3's CFA comes from rbp). 3000 allocations
// in a pseudo-random order: every one on its own path's stack, counts exact,
// and most of them replayed.
TEST(UnwindBpf, WalkMemoReplaysOnlyIdenticalStacks) {
  MEMTRACE_REQUIRE_ROOT();
  unsigned s = 12345, want[3] = {0, 0, 0};
  for (int i = 0; i < 3000; i++) {
    s = s * 1103515245u + 12345u;
    want[(s >> 16) % 3]++;
  }
  harness::Options opt;
  opt.mark_size = kMark;
  auto run = harness::trace({kTarget, "memo"}, opt);
  ASSERT_TRUE(run.ok()) << run.error().message;
  EXPECT_EQ(run->exit_status, 0) << "exit 3: m_a and m_b did not reach malloc at the same rsp";
  harness::Symbolizer sym(run->maps);
  unsigned got[3] = {0, 0, 0};
  for (const auto& st : run->stacks) {
    std::string names;
    for (auto ip : st.ips) names += norm(sym.name(ip)) + " ";
    auto has = [&](const char* f) { return names.find(std::string(" ") + f + " ") != std::string::npos; };
    names = " " + names;
    int path = has("m_a") ? 0 : has("m_b") ? 1 : has("c3") ? 2 : -1;
    ASSERT_GE(path, 0) << "stack on no known path: " << names;
    // each path's own frames, and none of the others' (a replay of the
    // wrong path's walk would mix them: stale words of the other layout)
    static const std::vector<const char*> own[3] = {
        {"m_leaf", "m_a", "w_a", "run", "main"},
        {"m_leaf", "m_b", "w_b", "run", "main"},
        {"c6", "c5", "c4", "c3", "c2", "c1", "run", "main"}};
    for (const char* f : own[path]) EXPECT_TRUE(has(f)) << "path " << path << " lacks " << f << ":" << names;
    for (int q = 0; q < 3; q++)
      if (q != path)
        for (const char* f : own[q])
          if (strcmp(f, "run") && strcmp(f, "main") && strcmp(f, "m_leaf")) {  // shared
            EXPECT_FALSE(has(f)) << "path " << path << " has " << f << ":" << names;
          }
    EXPECT_FALSE(st.flags & MT_F_STACK_TRUNCATED) << names;
    got[path] += st.count;
  }
  EXPECT_EQ(run->stacks.size(), 3u) << "one stack per path";
  for (int p = 0; p < 3; p++) EXPECT_EQ(got[p], want[p]) << "path " << p;
  EXPECT_EQ(run->counters[MT_UC_STACKS], 3000u);
  EXPECT_EQ(run->counters[MT_UC_END_OUTERMOST], 3000u) << "every stack complete";
  EXPECT_GT(run->counters[MT_UC_MEMO_HITS], 1000u) << "the memo was not exercised";
  EXPECT_LT(run->counters[MT_UC_MEMO_HITS], 3000u) << "a path change must miss";
  std::printf("memo: %lu of 3000 stacks replayed; paths %u %u %u\n",
              (unsigned long)run->counters[MT_UC_MEMO_HITS], want[0], want[1], want[2]);
}

// Without tables (unwind_disabled) the same chain is cut: malloc's caller
// (read at [rsp]) is there, c5, c4 and c3 are not (no frame records: c3
// keeps rbp for its alloca, so the walk goes from c6 to c3's caller c2):
// what the CFI walk is for. Past c2 the walk follows whatever main left in
// rbp (the environment's size moves it: one more junk frame on CI's
// machine), so the test names the frames it must miss, not a count.
TEST(UnwindBpf, FramePointersAloneAreShort) {
  MEMTRACE_REQUIRE_ROOT();
  harness::Options opt;
  opt.mark_size = kMark;
  opt.unwind = false;
  auto run = harness::trace({kTarget, "chain"}, opt);
  ASSERT_TRUE(run.ok()) << run.error().message;
  ASSERT_EQ(run->stacks.size(), 1u);
  harness::Symbolizer sym(run->maps);
  std::string names = " ";
  for (auto ip : run->stacks[0].ips) names += norm(sym.name(ip)) + " ";
  EXPECT_NE(names.find(" c6 "), std::string::npos) << "malloc's caller is read at [rsp]:" << names;
  for (const char* f : {"c5", "c4", "c3"})
    EXPECT_EQ(names.find(std::string(" ") + f + " "), std::string::npos) << f << " without tables:" << names;
}
