// Python frames in allocation stacks (issue 32) on CPython 3.13: Debian 13
// (trixie)'s python3.13, run with chroot in a root that trixie_root.sh makes
// from trixie's packages (once; cached in the build dir). The layout comes
// from the interpreter's own _Py_DebugOffsets, the thread state from its TLS
// variable; the oracle is tracemalloc in the same process, as for 3.11.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "harness.h"
#include "memtrace.h"
#include "procfs/proc_maps.h"
#include "py_oracle.h"
#include "python/python.h"
#include "shell.h"
#include "test_env.h"

using namespace memtrace::testing;
namespace py = memtrace::python;

namespace {

// The root, made once per build dir (flock: one maker at a time).
const std::string& trixie_root() {
  static std::string root = [] {
    std::string dir = std::string(TARGET_DIR) + "/trixie";
    std::string out = shell_output("flock " + dir + ".lock " + SCRIPT_DIR + "/trixie_root.sh " + dir + " 2>&1");
    while (!out.empty() && out.back() == '\n') out.pop_back();
    std::string last = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
    if (access((last + "/usr/bin/python3.13").c_str(), X_OK) != 0) return "error: " + out;
    return last;
  }();
  return root;
}

// The target inside the root: the same script as the 3.11 tests'.
std::string script_in_root() {
  std::string dst = trixie_root() + "/tmp/py_frames_target.py";
  shell_output(std::string("cp ") + SCRIPT_DIR + "/py_frames_target.py " + dst);
  return "/tmp/py_frames_target.py";
}

class Python313 : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();  // chroot
    if (trixie_root().rfind("error: ", 0) == 0) MEMTRACE_SKIP_OR_FAIL("no trixie root: " + trixie_root());
  }
  std::vector<std::string> python(std::vector<std::string> args) {
    std::vector<std::string> argv = {"/usr/sbin/chroot", trixie_root(), "/usr/bin/python3.13"};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }
};

class Python313Bpf : public Python313 {
 protected:
  void SetUp() override {
    Python313::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

// The interpreter of a live python3.13 in the chroot (its mappings name the
// files by their host paths): 3.13, its layout from _Py_DebugOffsets, its
// thread state a TLS variable; and code objects read with that layout name
// each instruction's line as the interpreter's own co_lines does.
TEST_F(Python313, ReadsTheLayoutFromDebugOffsetsAndCodeObjectsWithIt) {
  std::string prog =
      "import sys\n"
      "class K:\n"
      "    def meth(self, x):\n"
      "        y = x + 1\n"
      "        return [y,\n"
      "                y * 2]\n"
      "c = K.meth.__code__\n"
      "print(id(c), flush=True)\n"
      "for s, e, l in c.co_lines():\n"
      "    print('L', s, e, l, flush=True)\n"
      "print('ready', flush=True)\n"
      "sys.stdin.readline()\n";
  Child c = spawn(python({"-c", prog}));
  std::string acc;
  ASSERT_TRUE(read_until(c.out, "ready", &acc)) << acc;
  auto maps = memtrace::procfs::read_maps(c.pid);
  ASSERT_TRUE(maps);
  py::Detected d = py::detect(*maps);
  ASSERT_TRUE(d.interp) << d.unsupported;
  EXPECT_EQ(d.interp->major, 3);
  EXPECT_EQ(d.interp->minor, 13);
  EXPECT_EQ(d.interp->path, trixie_root() + "/usr/bin/python3.13");
  const py::Layout& l = d.interp->layout;
  EXPECT_TRUE(l.from_debug_offsets);
  EXPECT_TRUE(l.no_cframe);
  EXPECT_LT(l.tstate_tls, 0);
  EXPECT_GT(l.runtime_tss, 0u);  // autoTSSkey, for a thread that let the GIL go
  EXPECT_NE(l.frame_owner, 0);
  EXPECT_EQ(l.str_ascii_data, 40u);  // 3.12+: no wstr
  uint64_t code = std::stoull(acc);
  py::CodeReader r(c.pid, *d.interp);
  py::Counts counts;
  std::istringstream in(acc);
  std::string tok;
  int checked = 0;
  while (in >> tok) {
    if (tok != "L") continue;
    long s, e;
    std::string ln;
    in >> s >> e >> ln;
    for (long off = s; off < e; off += 2) {
      // instr_ptr at the instruction of byte offset off
      auto f = r.frame(code, code + l.co_code_units + off, counts);
      ASSERT_TRUE(f);
      EXPECT_EQ(f->function, "K.meth");
      EXPECT_EQ(f->file, "<string>");
      EXPECT_EQ(f->line, ln == "None" ? 0 : std::stoi(ln)) << "offset " << off;
      checked++;
    }
  }
  close(c.in);
  wait_exit(c.pid);
  EXPECT_GT(checked, 5);
  EXPECT_EQ(counts.code_unreadable, 0u);
}

// The structure checked, not trusted: another cookie, another version, a
// shifted group: each refused with one line.
TEST(Python313Layout, DebugOffsetsAreChecked) {
  std::vector<uint8_t> b(584, 0);
  EXPECT_FALSE(py::layout_from_debug_offsets(b, 0x452f0));
  memcpy(b.data(), "xdebugpy", 8);
  uint64_t v = 0x030d05f0;
  memcpy(b.data() + 8, &v, 8);
  auto r = py::layout_from_debug_offsets(b, 0x452f0);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("not laid out as 3.13's"), std::string::npos) << r.error().message;
  v = 0x030e00f0;
  memcpy(b.data() + 8, &v, 8);
  r = py::layout_from_debug_offsets(b, 0x452f0);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("version 3.14"), std::string::npos) << r.error().message;
  // _PyThreadState_GetCurrent: endbr64; mov %fs:-0x18,%rax; ret
  std::vector<uint8_t> get = {0xf3, 0x0f, 0x1e, 0xfa, 0x64, 0x48, 0x8b, 0x04, 0x25, 0xe8, 0xff, 0xff, 0xff, 0xc3};
  EXPECT_EQ(py::tls_offset_from_code(get), -0x18);
  get[4] = 0x90;
  EXPECT_FALSE(py::tls_offset_from_code(get));
  // PyGILState_GetThisThreadState (trixie's 3.13.5 at 0x523400, _PyRuntime at
  // 0xa3f400): endbr64; cmpl $0,autoTSSkey(%rip); je ...; mov autoTSSkey+4(%rip),%edi
  std::vector<uint8_t> gs = {0xf3, 0x0f, 0x1e, 0xfa, 0x83, 0x3d, 0x65, 0xc8, 0x51, 0x00, 0x00, 0x0f, 0x84, 0xd0,
                             0x2a, 0xf0, 0xff, 0x8b, 0x3d, 0x5d, 0xc8, 0x51, 0x00, 0xe9, 0x94, 0xe3, 0xef, 0xff};
  EXPECT_EQ(py::tss_offset_from_code(gs, 0x523400, 0xa3f400, 0x452f0), 0x870u);
  EXPECT_FALSE(py::tss_offset_from_code(gs, 0x523400, 0xa3f400, 0x800));  // outside _PyRuntime
  gs[19] = 0x61;  // the mov reads another word than the key's
  EXPECT_FALSE(py::tss_offset_from_code(gs, 0x523400, 0xa3f400, 0x452f0));
}

void expect_tracemallocs_lines(const ToolRun& r) {
  expect_same_as_tracemalloc(r, parse_oracle(r.out), "python3.13");
  // the walk found frames: no stack of the script's line without them
  EXPECT_GT(r.report["stats"].value("python_code_records", 0), 0) << r.report["stats"].dump();
}

TEST_F(Python313Bpf, LaunchedDefaultAllocatorChargesTracemallocsLinesOfBigBlocks) {
  std::vector<std::string> args = {"--"};
  for (const auto& a : python({script_in_root()})) args.push_back(a);
  ToolRun r = run_tool(args);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_tracemallocs_lines(r);
}

TEST_F(Python313Bpf, LaunchedPythonMallocMallocChargesTracemallocsLines) {
  std::vector<std::string> args = {"--"};
  for (const auto& a : python({script_in_root()})) args.push_back(a);
  setenv("PYTHONMALLOC", "malloc", 1);
  ToolRun r = run_tool(args);
  unsetenv("PYTHONMALLOC");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_tracemallocs_lines(r);
}

// --inject into a process in another root (the chroot's python3.13, our
// PID namespace): the agent's ring and a copy of it in the root's /dev/shm
// (trixie_root.sh gives it one, and libunwind8), its Python frames walked
// in-process with 3.13's layout: tracemalloc's lines again.
TEST_F(Python313Bpf, InjectInAChrootChargesTracemallocsLines) {
  std::vector<std::string> args = {"--inject", "--"};
  for (const auto& a : python({script_in_root()})) args.push_back(a);
  ToolRun r = run_tool(args);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err.find("uprobes instead"), std::string::npos) << r.err;
  EXPECT_GE(r.report["stats"].value("inject_sessions_ended", 0), 1) << r.report["stats"].dump();
  expect_tracemallocs_lines(r);
}

// A C call with the GIL released (ctypes' foreign call to libc's malloc):
// 3.13's _Py_tss_tstate is NULL then, and the Python frames come through the
// thread's TSS key (autoTSSkey). Every block of the call's size is charged
// to the line that made the call, under the chain of lines above it.
TEST_F(Python313Bpf, MallocWithTheGilReleasedKeepsItsPythonFrames) {
  const int N = 25;
  std::string prog =
      "import ctypes\n"                                     // 1
      "libc = ctypes.CDLL(None)\n"                          // 2
      "libc.malloc.restype = ctypes.c_void_p\n"             // 3
      "libc.malloc.argtypes = [ctypes.c_size_t]\n"          // 4
      "keep = []\n"                                         // 5
      "def inner():\n"                                      // 6
      "    for _ in range(" + std::to_string(N) + "):\n"    // 7
      "        keep.append(libc.malloc(7777))\n"            // 8
      "def middle():\n"                                     // 9
      "    inner()\n"                                       // 10
      "def outer():\n"                                      // 11
      "    middle()\n"                                      // 12
      "outer()\n";                                          // 13
  std::string dst = trixie_root() + "/tmp/py_nogil_target.py";
  {
    std::ofstream f(dst);
    f << prog;
  }
  std::vector<std::string> args = {"--"};
  for (const auto& a : python({"/tmp/py_nogil_target.py"})) args.push_back(a);
  ToolRun r = run_tool(args);
  unlink(dst.c_str());
  ASSERT_EQ(r.code, 0) << r.err;
  const json* p = find_comm(r.report, "python3.13");
  ASSERT_TRUE(p) << r.report.dump().substr(0, 2000);
  long blocks = 0, bytes = 0;
  std::string chain;
  std::vector<std::string> names;
  for (const auto& g : p->value("leaks", json::array())) {
    if (g.value("bytes", 0l) != 7777l * g.value("blocks", 0l)) continue;
    blocks += g.value("blocks", 0l);
    bytes += g.value("bytes", 0l);
    names.clear();
    chain = py_chain(g["stack"], &names);
  }
  EXPECT_EQ(blocks, N);
  EXPECT_EQ(bytes, 7777l * N);
  EXPECT_EQ(chain, "py_nogil_target.py:8 < py_nogil_target.py:10 < py_nogil_target.py:12 < py_nogil_target.py:13");
  EXPECT_EQ(names, (std::vector<std::string>{"inner", "middle", "outer", "<module>"}));
}

}  // namespace
