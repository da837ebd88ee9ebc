// Python frames in allocation stacks (issue 32), on Debian 12's
// /usr/bin/python3.11: the pieces of src/python against a real interpreter,
// and the BPF path against tracemalloc (the program's own oracle:
// tests/python/py_frames_target.py prints what it charges to its line).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <map>
#include <regex>

#include "harness.h"
#include "py_oracle.h"
#include "procfs/proc_maps.h"
#include "memtrace.h"
#include "python/python.h"
#include "shell.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;
namespace py = memtrace::python;

namespace {

const char* kPython = "/usr/bin/python3.11";
std::string script() { return std::string(SCRIPT_DIR) + "/py_frames_target.py"; }

class Python : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kPython, X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no /usr/bin/python3.11 (Debian 12's python3.11)");
  }
};

class PythonBpf : public Python {
 protected:
  void SetUp() override {
    Python::SetUp();
    if (IsSkipped()) return;
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

// The interpreter found in a live python3.11: version, _PyEval_EvalFrameDefault
// and its .cold part (checked against the debug file's symbols: the binary is stripped).
TEST_F(Python, DetectsDebianPython311AndItsColdPart) {
  Child c = spawn({kPython, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()"});
  std::string acc;
  ASSERT_TRUE(read_until(c.out, "ready", &acc));
  auto maps = memtrace::procfs::read_maps(c.pid);
  ASSERT_TRUE(maps);
  py::Detected d = py::detect(*maps);
  close(c.in);
  wait_exit(c.pid);
  ASSERT_TRUE(d.interp) << d.unsupported;
  EXPECT_EQ(d.interp->major, 3);
  EXPECT_EQ(d.interp->minor, 11);
  ASSERT_GE(d.interp->eval.size(), 2u);
  // The debug file's _PyEval_EvalFrameDefault and _PyEval_EvalFrameDefault.cold.
  std::string bid = shell_output("readelf -n /usr/bin/python3.11 | awk '/Build ID/{printf \"%s\", $3}'");
  ASSERT_GT(bid.size(), 2u);
  std::string syms = shell_output("readelf -Ws /usr/lib/debug/.build-id/" + bid.substr(0, 2) + "/" + bid.substr(2) +
                                  ".debug 2>/dev/null | awk '$8 ~ /^_PyEval_EvalFrameDefault(\\.cold)?$/ "
                                  "{print $8, $2, $3}'");
  if (syms.empty()) MEMTRACE_SKIP_OR_FAIL("python3.11-dbg's debug file missing");
  std::map<std::string, std::pair<uint64_t, uint64_t>> want;
  std::istringstream in(syms);
  std::string name, addr;
  uint64_t size;
  while (in >> name >> addr >> size) want[name] = {std::stoull(addr, nullptr, 16), size};
  ASSERT_TRUE(want.count("_PyEval_EvalFrameDefault.cold")) << syms;
  EXPECT_EQ(d.interp->eval[0].first, want["_PyEval_EvalFrameDefault"].first);
  EXPECT_EQ(d.interp->eval[0].second - d.interp->eval[0].first, want["_PyEval_EvalFrameDefault"].second);
  bool cold = false;
  for (size_t i = 1; i < d.interp->eval.size(); i++)
    if (d.interp->eval[i].first == want["_PyEval_EvalFrameDefault.cold"].first &&
        d.interp->eval[i].second - d.interp->eval[i].first == want["_PyEval_EvalFrameDefault.cold"].second)
      cold = true;
  EXPECT_TRUE(cold) << "no .cold part at " << std::hex << want["_PyEval_EvalFrameDefault.cold"].first;
  std::string parts;
  for (auto [lo, hi] : d.interp->eval) parts += std::to_string(lo) + "-" + std::to_string(hi) + " ";
  EXPECT_EQ(d.interp->eval.size(), 2u) << "other code taken for a .cold part: " << parts;
}

// Code objects read from a live process: the names, file and line of a
// function's instructions, each line as the interpreter's own co_lines says.
TEST_F(Python, ReadsCodeObjectsAndTheirLinesFromALiveProcess) {
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
  Child c = spawn({kPython, "-c", prog});
  std::string acc;
  ASSERT_TRUE(read_until(c.out, "ready", &acc));
  auto maps = memtrace::procfs::read_maps(c.pid);
  ASSERT_TRUE(maps);
  py::Detected d = py::detect(*maps);
  ASSERT_TRUE(d.interp);
  uint64_t code = std::stoull(acc);
  py::CodeReader r(c.pid, *d.interp);
  py::Counts counts;
  std::istringstream in(acc);
  std::string tok;
  int checked = 0;
  while (in >> tok) {
    if (tok != "L") continue;
    long s, e;
    std::string l;
    in >> s >> e >> l;
    for (long off = s; off < e; off += 2) {
      // prev_instr points at the instruction at byte offset off.
      auto f = r.frame(code, code + 184 + off, counts);
      ASSERT_TRUE(f);
      EXPECT_EQ(f->function, "K.meth");
      EXPECT_EQ(f->file, "<string>");
      EXPECT_EQ(f->line, l == "None" ? 0 : std::stoi(l)) << "offset " << off;
      checked++;
    }
  }
  close(c.in);
  wait_exit(c.pid);
  EXPECT_GT(checked, 5);
  EXPECT_EQ(counts.code_unreadable, 0u);
  // A frame that has not started yet (prev_instr one unit before the code): its first line.
  EXPECT_EQ(py::line_at(std::string("\x80", 1), 7, -2), 7);
}

// The splice: native frames in _PyEval_EvalFrameDefault replaced by their
// evaluation's frames, up to the entry frame; the others stay.
TEST(PythonSplice, EachEvalFrameTakesItsFramesUpToTheEntryFrame) {
  py::Interpreter in;
  in.eval = {{0x1000, 0x2000}, {0x5000, 0x5100}};
  const uint64_t E = MT_PY_ENTRY;
  // malloc's caller, eval (hot), a C function, eval (cold), main
  uint64_t ips[] = {0x9001, 0x1500, 0x9100, 0x5010, 0x9200};
  uint64_t pairs[] = {10, 1, 11, 2 | E, 12, 3, 13, 4 | E};
  py::Counts c;
  bool cut = false;
  auto name = [](uint64_t code, uint64_t instr) { return (uint64_t{1} << 62) | code << 8 | instr; };
  auto out = py::splice(ips, 5, pairs, 4, py::Mode::On, in, name, 128, &cut, c);
  std::vector<uint64_t> want = {0x9001, name(10, 1), name(11, 2), 0x9100, name(12, 3), name(13, 4), 0x9200};
  EXPECT_EQ(out, want);
  out = py::splice(ips, 5, pairs, 4, py::Mode::Only, in, name, 128, &cut, c);
  EXPECT_EQ(out, (std::vector<uint64_t>{name(10, 1), name(11, 2), name(12, 3), name(13, 4)}));
  out = py::splice(ips, 5, pairs, 4, py::Mode::On, in, name, 3, &cut, c);
  EXPECT_TRUE(cut);
  EXPECT_EQ(out.size(), 3u);
  EXPECT_EQ(c.unspliced, 0u);
}

TEST_F(PythonBpf, LaunchedPythonMallocMallocChargesTracemallocsLines) {
  setenv("PYTHONMALLOC", "malloc", 1);
  ToolRun r = run_tool({"--", kPython, script()});
  unsetenv("PYTHONMALLOC");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_as_tracemalloc(r, parse_oracle(r.out));
}

TEST_F(PythonBpf, LaunchedDefaultAllocatorChargesTracemallocsLinesOfBigBlocks) {
  ToolRun r = run_tool({"--", kPython, script()});
  ASSERT_EQ(r.code, 0) << r.err;
  Oracle o = parse_oracle(r.out);
  expect_same_as_tracemalloc(r, o);
  // The native frames around the Python ones stay: bytearray's C code below them.
  const json* p = find_comm(r.report, "python3.11");
  ASSERT_TRUE(p);
  bool native_inside = false;
  for (const auto& g : p->value("leaks", json::array()))
    if (py_chain(g["stack"]).rfind("py_frames_target.py:" + std::to_string(o.line), 0) == 0 &&
        g["stack"][0].value("module", "") != "python")
      native_inside = true;
  EXPECT_TRUE(native_inside);
}

// The interpreter in Debian's libpython3.11.so.1.0, not in the executable
// (a --enable-shared build, or any program that embeds Python): found by
// its mapping, the same lines and chain as tracemalloc's.
TEST_F(PythonBpf, InterpreterInLibpythonChargesTracemallocsLines) {
#ifndef PY_EMBED
  MEMTRACE_SKIP_OR_FAIL("no py_embed: libpython3.11-dev (python-3.11-embed.pc) was not found at build time");
#else
  ToolRun r = run_tool({"--", PY_EMBED, script()});
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_as_tracemalloc(r, parse_oracle(r.out), "py_embed");
#endif
}

TEST_F(PythonBpf, OnlyAndOffModes) {
  ToolRun only = run_tool({"--python-frames=only", "--", kPython, script()});
  ASSERT_EQ(only.code, 0) << only.err;
  Oracle o = parse_oracle(only.out);
  const json* p = find_comm(only.report, "python3.11");
  ASSERT_TRUE(p);
  bool seen = false;
  for (const auto& g : p->value("leaks", json::array())) {
    if (py_chain(g["stack"]) != o.chain) continue;
    seen = true;
    for (const auto& f : g["stack"]) EXPECT_EQ(f.value("module", ""), "python") << f.dump();
  }
  EXPECT_TRUE(seen);
  ToolRun off = run_tool({"--python-frames=off", "--", kPython, script()});
  ASSERT_EQ(off.code, 0) << off.err;
  p = find_comm(off.report, "python3.11");
  ASSERT_TRUE(p);
  for (const auto& g : p->value("leaks", json::array())) EXPECT_EQ(py_chain(g["stack"]), "");
}

// The text report: each Python frame reads "function (file.py:line) in
// python", without the tagged id that stands for it in the stack tables
// (0x8000... is no address a reader can look up).
TEST_F(PythonBpf, TextReportShowsPythonFramesWithoutAnAddress) {
  std::string rep = tmpfile("pytext");
  ToolRun r = run_argv({tool(), "--format", "text", "-o", rep, "--", kPython, script()});
  ASSERT_EQ(r.code, 0) << r.err;
  Oracle o = parse_oracle(r.out);
  ASSERT_GT(o.line, 0) << r.out;
  std::ifstream f(rep);
  std::stringstream ss;
  ss << f.rdbuf();
  unlink(rep.c_str());
  std::string want = "    inner (" + script() + ":" + std::to_string(o.line) + ") in python\n";
  EXPECT_NE(ss.str().find(want), std::string::npos) << ss.str().substr(0, 4000);
  EXPECT_EQ(ss.str().find(" 0x80000000"), std::string::npos);
}

// gdb's py-bt (Debian's python3.11-dbg) as the oracle for the Python frames
// of 20 allocations, each under its own call chain and of its own size
// (py_chains_target.py: chain k makes a block of 4001 + 16k bytes): gdb stops
// at each of those mallocs and prints the Python stack; the tool's stack of
// the block of that size must hold the same frames, function and line,
// innermost first. py-bt names a frame by co_name, the tool by co_qualname
// ("C.m"): compared on the part after the last dot.
using PyFrames = std::vector<std::pair<std::string, int>>;

std::map<long, PyFrames> py_bt_of_chains(const std::string& script) {
  std::string cmds = tmpfile("pybt");
  {
    std::ofstream f(cmds);
    f << "set pagination off\nset confirm off\n"
      << "break malloc if $rdi >= 4001 && $rdi < 4400 && ($rdi - 4001) % 16 == 0\n"
      << "commands\nsilent\nprintf \"SIZE %d\\n\", $rdi\npy-bt\ncontinue\nend\nrun\n";
  }
  ToolRun g = run_argv({"/usr/bin/gdb", "-q", "-batch", "-nx", "-iex", "set auto-load safe-path /", "-x", cmds,
                        "--args", kPython, script});
  unlink(cmds.c_str());
  std::map<long, PyFrames> out;
  std::regex file_line(R"re(^\s*File "([^"]*)", line (\d+), in (\S+))re");
  std::istringstream in(g.out);
  std::string line;
  PyFrames* cur = nullptr;
  while (std::getline(in, line)) {
    std::smatch m;
    if (line.rfind("SIZE ", 0) == 0) {
      cur = &out[atol(line.c_str() + 5)];
      cur->clear();
    } else if (cur && std::regex_search(line, m, file_line) && m[1] == script) {
      cur->push_back({m[3], std::stoi(m[2])});
    }
  }
  return out;
}

TEST_F(PythonBpf, PythonFramesEqualGdbPyBtAtTwentyAllocations) {
  if (access("/usr/bin/gdb", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no gdb");
  if (access("/usr/share/gdb/auto-load/usr/bin/python3.11-gdb.py", R_OK) != 0)
    MEMTRACE_SKIP_OR_FAIL("no py-bt: python3.11-dbg not installed");
  std::string chains = std::string(SCRIPT_DIR) + "/py_chains_target.py";
  std::map<long, PyFrames> want = py_bt_of_chains(chains);
  ASSERT_EQ(want.size(), 20u) << "gdb stopped at " << want.size() << " of the 20 allocations";
  ToolRun r = run_tool({"--top", "1000", "--", kPython, chains});
  ASSERT_EQ(r.code, 0) << r.err;
  const json* p = find_comm(r.report, "python3.11");
  ASSERT_TRUE(p) << r.err;
  std::map<long, PyFrames> got;
  for (const auto& g : p->value("leaks", json::array())) {
    long blocks = g.value("blocks", 0l), size = blocks ? g.value("bytes", 0l) / blocks : 0;
    if (!want.count(size) || blocks != 1) continue;
    PyFrames fs;
    for (const auto& f : g["stack"]) {
      if (f.value("module", "") != "python" || f.value("file", "") != chains) continue;
      std::string fn = f.value("function", "");
      fs.push_back({fn.substr(fn.rfind('.') == std::string::npos ? 0 : fn.rfind('.') + 1), f.value("line", 0)});
    }
    got[size] = fs;
  }
  int compared = 0;
  for (const auto& [size, frames] : want) {
    ASSERT_GE(frames.size(), 3u) << "py-bt at size " << size;
    EXPECT_EQ(got[size], frames) << "the block of " << size << " bytes";
    compared += got[size] == frames;
  }
  EXPECT_EQ(compared, 20);
}

// A recording keeps the frames' names: replay reports the same Python stack.
TEST_F(PythonBpf, ReplayNamesThePythonFrames) {
  std::string rec = "/tmp/memtrace-pyframes-" + std::to_string(getpid()) + ".rec";
  ToolRun r = run_tool({"--record", rec, "--", kPython, script()});
  ASSERT_EQ(r.code, 0) << r.err;
  Oracle o = parse_oracle(r.out);
  ToolRun rp = run_argv({tool(), "replay", "--format", "json", rec});
  unlink(rec.c_str());
  ASSERT_EQ(rp.code, 0) << rp.err;
  json rep = json::parse(rp.out, nullptr, false);
  Charged ch = charged(rep, "python3.11", o.line, 512);
  EXPECT_EQ(ch.chain, o.chain);
  EXPECT_EQ(ch.blocks, o.big_blocks);
}

// --inject: the agent walks the frames inside the process and sends each
// code object's record itself (src/inject/agent.c): the same line, chain
// and bytes as tracemalloc's, every frame named from those records (none
// read from the process's memory, which is gone by the end: the launched
// script exits at once).
TEST_F(PythonBpf, InjectChargesTracemallocsLines) {
  ToolRun r = run_tool({"--inject", "--", kPython, script()});  // the default allocator: malloc sees the big blocks
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(r.report.is_object()) << r.err;
  // injected (the sessions' counters are there), not the uprobes' fallback
  EXPECT_TRUE(r.report["stats"].contains("inject_full_waits")) << r.report["stats"].dump();
  EXPECT_EQ(r.err.find("traced with uprobes instead"), std::string::npos) << r.err;
  expect_same_as_tracemalloc(r, parse_oracle(r.out));
  EXPECT_GT(r.report["stats"].value("python_code_records", 0), 0);
  EXPECT_EQ(r.report["stats"].value("python_code_read_from_memory", 1), 0) << r.report["stats"].dump();
  EXPECT_EQ(r.report["dropped"].value("python_frames_of_gone_process", 1), 0);
  EXPECT_EQ(r.report["dropped"].value("python_frames_cut", 1), 0);
}

// -p on a running `python3 -m http.server` answering curl: its stacks name
// the stdlib's Python functions, on both paths.
void http_server_stacks_name_python_functions(const std::vector<std::string>& extra) {
  if (access("/usr/bin/curl", X_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no curl");
  int port = 18000 + getpid() % 1000;
  Child srv = spawn({kPython, "-u", "-m", "http.server", std::to_string(port), "--bind", "127.0.0.1",
                     "--directory", "/usr/share/doc"});
  std::string acc;
  ASSERT_TRUE(read_until(srv.out, "Serving HTTP", &acc)) << acc;
  std::string rep = tmpfile("http");
  std::vector<std::string> argv = {tool(), "--format", "json", "-o", rep};
  argv.insert(argv.end(), extra.begin(), extra.end());
  for (const char* a : {"-p", "", "--duration", "12"}) argv.push_back(*a ? a : std::to_string(srv.pid));
  Child tool_c = spawn(argv);
  sleep(4);  // attached (the tool's start-up takes ~1.5 s)
  std::string curl = "for i in $(seq 300); do curl -s -o /dev/null http://127.0.0.1:" + std::to_string(port) +
                     "/ ; done";
  ASSERT_EQ(system(curl.c_str()), 0);
  wait_exit(tool_c.pid);
  kill(srv.pid, SIGTERM);
  wait_exit(srv.pid);
  std::ifstream fi(rep);
  std::stringstream ss;
  ss << fi.rdbuf();
  unlink(rep.c_str());
  json j = json::parse(ss.str().substr(report_offset(ss.str())), nullptr, false);
  ASSERT_TRUE(j.is_object());
  std::string all = j.dump();
  for (const char* fn : {"\"BaseHTTPRequestHandler.handle_one_request\"", "\"SimpleHTTPRequestHandler.list_directory\"",
                         "\"BaseServer.serve_forever\""})
    EXPECT_NE(all.find(fn), std::string::npos) << fn;
  EXPECT_EQ(j["dropped"].value("python_code_unreadable", 1), 0) << j["dropped"].dump();
}

TEST_F(PythonBpf, AttachedHttpServerStacksNamePythonFunctions) { http_server_stacks_name_python_functions({}); }

TEST_F(PythonBpf, InjectAttachedHttpServerStacksNamePythonFunctions) {
  http_server_stacks_name_python_functions({"--inject"});
}

}  // namespace
