// The python domain (issue 32): CPython's pymalloc traced beside malloc on
// the BPF path, on Debian 12's /usr/bin/python3.11 (LTO + PGO: pymalloc
// inlined behind compares, src/python/pymem.h). The target
// (py_pymem_target.py) keeps N = 1000 blocks of 133 bytes and M = 50 of
// 2,033 from two lines; under tracemalloc it prints what tracemalloc
// charges to each (the oracle).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "harness.h"
#include "memtrace.h"
#include "procfs/proc_maps.h"
#include "python/pymem.h"
#include "python/python.h"
#include "shell.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;
namespace py = memtrace::python;

namespace {

const char* kPython = "/usr/bin/python3.11";
std::string script() { return std::string(SCRIPT_DIR) + "/py_pymem_target.py"; }

struct Line {
  int line = 0;
  long bytes = -1, blocks = -1;  // tracemalloc's (tm runs)
};
// "SMALL line 18 133000 bytes 1000 blocks" (or "SMALL line 18")
Line oracle(const std::string& out, const std::string& tag) {
  Line l;
  auto at = out.find(tag + " line ");
  if (at != std::string::npos)
    sscanf(out.c_str() + at + tag.size(), " line %d %ld bytes %ld blocks", &l.line, &l.bytes, &l.blocks);
  return l;
}

// The live blocks of the leak groups whose innermost Python frame is the target's line.
struct Charged {
  long bytes = 0, blocks = 0, python_blocks = 0;
};
Charged charged(const json& rep, int line) {
  Charged c;
  const json* p = find_comm(rep, "python3.11");
  if (!p) return c;
  for (const auto& g : p->value("leaks", json::array())) {
    for (const auto& f : g["stack"]) {
      if (f.value("module", "") != "python") continue;
      std::string file = f.value("file", "");
      if (file.substr(file.rfind('/') + 1) == "py_pymem_target.py" && f.value("line", 0) == line) {
        c.bytes += g.value("bytes", 0l);
        c.blocks += g.value("blocks", 0l);
        c.python_blocks += g.value("python_blocks", 0l);
      }
      break;  // the innermost Python frame only
    }
  }
  return c;
}

const json& python_domain(const json& rep) {
  static const json none = json::object();
  const json* p = find_comm(rep, "python3.11");
  if (!p || !(*p)["summary"].contains("domains")) return none;
  return (*p)["summary"]["domains"]["python"];
}

class PyMem : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kPython, X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/python3.11 (Debian 12's python3.11)");
  }
};

class PyMemBpf : public PyMem {
 protected:
  void SetUp() override {
    PyMem::SetUp();
    if (IsSkipped()) return;
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

// pymalloc's functions as a live python3.11's allocator structs point to
// them: _PyObject_Malloc reached through a jmp of the interpreter's own
// code (its slot moved there: PGO inlined it behind a compare), the others
// probed on themselves at an emulated instruction.
TEST_F(PyMem, FindsPymallocInDebianPython311) {
  Child c = spawn({kPython, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()"});
  std::string acc;
  ASSERT_TRUE(read_until(c.out, "ready", &acc));
  auto maps = memtrace::procfs::read_maps(c.pid);
  ASSERT_TRUE(maps);
  py::Detected d = py::detect(*maps);
  ASSERT_TRUE(d.interp) << d.unsupported;
  std::string why;
  auto pm = py::find_pymalloc(c.pid, *d.interp, *maps, &why);
  close(c.in);
  wait_exit(c.pid);
  ASSERT_TRUE(pm) << why;
  ASSERT_EQ(pm->sites.size(), 4u) << pm->note;
  // python3.11-dbg's DWARF names the functions (the binary is stripped): gdb.
  std::string syms = shell_output(
      "gdb -batch -ex 'info address _PyObject_Malloc' -ex 'info address _PyObject_Calloc' "
      "-ex 'info address _PyObject_Realloc' -ex 'info address _PyObject_Free' /usr/bin/python3.11 2>/dev/null | "
      "sed -n 's/^Symbol \"\\(_PyObject_[A-Za-z]*\\)\" is a function at address \\(0x[0-9a-f]*\\)\\./\\1 \\2/p'");
  if (syms.find("_PyObject_Free ") == std::string::npos) MEMTRACE_SKIP_OR_FAIL("python3.11-dbg's debug file missing: " + syms);
  for (const auto& s : pm->sites) {
    EXPECT_TRUE(s.placement.emulated) << s.name << ": " << memtrace::probes::describe(s.placement);
    if (s.role == MT_ROLE_PY_MALLOC) {
      EXPECT_EQ(s.name.rfind("jmp _PyObject_Malloc", 0), 0u) << s.name;
      continue;
    }
    auto at = syms.find(s.name + " ");
    ASSERT_NE(at, std::string::npos) << s.name << " not in " << syms;
    EXPECT_EQ(std::stoull(syms.substr(at + s.name.size() + 1, 16), nullptr, 16), s.vaddr) << s.name;
  }
  EXPECT_EQ(pm->slots.size(), 2u) << pm->note;  // _PyObject's and _PyMem's malloc
}

// Under tracemalloc: the blocks the two lines keep, in the python domain,
// as tracemalloc charges them (the 2,033-byte ones pymalloc hands to malloc
// counted once, in the python domain).
TEST_F(PyMemBpf, PythonDomainChargesTracemallocsLines) {
  ToolRun r = run_tool({"--", kPython, script(), "tm"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* tag : {"SMALL", "BIG"}) {
    Line o = oracle(r.out, tag);
    ASSERT_GT(o.line, 0) << r.out;
    ASSERT_GT(o.blocks, 0) << r.out;
    Charged c = charged(r.report, o.line);
    EXPECT_NEAR(double(c.bytes), double(o.bytes), 0.01 * o.bytes) << tag;
    EXPECT_NEAR(double(c.blocks), double(o.blocks), 0.01 * o.blocks) << tag;
    EXPECT_EQ(c.python_blocks, c.blocks) << tag;
  }
  EXPECT_GE(python_domain(r.report).value("in_use_blocks", 0l), 1050);
}

// Without tracemalloc (no hooks: the interpreter's own inlined calls): the
// same blocks, exact.
TEST_F(PyMemBpf, PythonDomainCountsTheKeptBlocksExactly) {
  ToolRun r = run_tool({"--", kPython, script()});
  ASSERT_EQ(r.code, 0) << r.err;
  Charged s = charged(r.report, oracle(r.out, "SMALL").line);
  EXPECT_EQ(s.blocks, 1000);
  EXPECT_EQ(s.bytes, 133000);
  EXPECT_EQ(s.python_blocks, 1000);
  Charged b = charged(r.report, oracle(r.out, "BIG").line);
  EXPECT_EQ(b.blocks, 50);
  EXPECT_EQ(b.bytes, 50 * 2033);
  EXPECT_EQ(b.python_blocks, 50);
  const json& d = python_domain(r.report);
  EXPECT_GE(d.value("in_use_blocks", 0l), 1050) << d.dump();
  EXPECT_GE(d.value("allocs", 0l), 1050) << d.dump();
}

// PYTHONMALLOC=malloc: no python domain, the blocks are malloc's as before.
TEST_F(PyMemBpf, PythonMallocMallocLeavesEverythingToMalloc) {
  setenv("PYTHONMALLOC", "malloc", 1);
  ToolRun r = run_tool({"--", kPython, script()});
  unsetenv("PYTHONMALLOC");
  ASSERT_EQ(r.code, 0) << r.err;
  Charged s = charged(r.report, oracle(r.out, "SMALL").line);
  EXPECT_EQ(s.blocks, 1000);
  EXPECT_EQ(s.bytes, 133000);
  EXPECT_EQ(s.python_blocks, 0);
  EXPECT_EQ(python_domain(r.report).value("allocs", -1l), 0) << r.report.dump().substr(0, 2000);
}

}  // namespace
