// System-wide tracing on a busy host (issue 17): background load, a known
// program started in the middle, its counts exact, no ring drop, its
// mappings captured although it lives only a few hundred ms.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>

#include "harness.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;

namespace {

class BusyHost : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
  }
};

// alloc_rounds --rounds R, its pid and stdout.
std::pair<pid_t, std::string> run_known(long rounds) {
  Child t = spawn({target("alloc_rounds"), "--rounds", std::to_string(rounds)});
  close(t.in);
  std::string out = read_all(t.out);
  close(t.out);
  close(t.err);
  EXPECT_EQ(wait_exit(t.pid), 0);
  return {t.pid, out};
}

// SIGINT to the tool, its stderr appended to err, its JSON report at rep
// (null if it did not exit 0 or wrote none).
json stop_tool(Child& m, const std::string& rep, std::string& err) {
  kill(m.pid, SIGINT);
  std::thread drain([&] { err += read_all(m.err); });
  int code = wait_exit(m.pid);
  drain.join();
  EXPECT_EQ(code, 0) << err;
  std::ifstream f(rep);
  json j = json::parse(f, nullptr, false);
  unlink(rep.c_str());
  return code == 0 ? j : json();
}

bool stack_has(const json& p, long block_bytes, const std::string& function) {
  for (const auto& l : p["leaks"]) {
    if (l["blocks"].get<long>() == 0 || l["bytes"].get<long>() % block_bytes) continue;
    for (const auto& f : l["stack"])
      if (f.value("function", "") == function) return true;
  }
  return false;
}

}  // namespace

// Two processes allocating as fast as they can (each ~10^5-10^6 events/s
// traced on a 2-vCPU VM) and a shell starting short processes in a loop,
// for ~12 s; alloc_rounds --rounds 0 and --rounds R in the middle: the
// difference of their reports is exactly R x the program's per-round counts,
// nothing was dropped from the rings, and its leak's stack is symbolized
// (its mappings were read while it lived).
TEST_F(BusyHost, KnownProgramExactUnderLoadSystemWide) {
  std::string rep = tmpfile("busy");
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "5"});
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;

  const int kStormSeconds = 10;
  std::vector<Child> load;
  for (int i = 0; i < 2; i++)
    load.push_back(spawn({target("alloc_storm"), "--seconds", std::to_string(kStormSeconds)}));
  load.push_back(spawn({"/bin/sh", "-c", "while :; do ls / >/dev/null; /bin/true; done"}));
  for (auto& c : load) close(c.in);
  sleep(3);

  const long R = 300;
  auto [pid0, out0] = run_known(0);
  auto [pidn, outn] = run_known(R);
  sleep(2);

  kill(load[2].pid, SIGKILL);
  std::string storm_out;
  for (auto& c : load) {
    std::string o = read_all(c.out);
    if (c.pid != load[2].pid) storm_out += o;
    wait_exit(c.pid);
    close(c.out);
    close(c.err);
  }
  json j = stop_tool(m, rep, merr);
  ASSERT_TRUE(j.is_object()) << merr;

  // The load was real: events counted, pairs made.
  long events = j["stats"]["events"].get<long>();
  std::cerr << "events " << events << ", storms: " << storm_out << "dropped " << j["dropped"].dump()
            << "\nmappings_not_captured " << j["stats"]["mappings_not_captured"] << "\n";
  EXPECT_GT(events, 500000);

  PerRound per = parse_per_round(outn);
  ASSERT_GT(per.allocs, 0) << outn;
  const json* p0 = find_proc(j, pid0);
  const json* pn = find_proc(j, pidn);
  ASSERT_TRUE(p0 && pn) << "known program not in the report (" << j["processes"].size() << " processes)";
  EXPECT_EQ(u(*pn, "allocs") - u(*p0, "allocs"), R * per.allocs);
  EXPECT_EQ(u(*pn, "frees") - u(*p0, "frees"), R * per.frees);
  EXPECT_EQ(u(*pn, "bytes_allocated") - u(*p0, "bytes_allocated"), R * per.bytes);
  EXPECT_EQ(u(*pn, "failed_allocs") - u(*p0, "failed_allocs"), R * per.failed);
  EXPECT_EQ(u(*pn, "in_use_blocks") - u(*p0, "in_use_blocks"), R * per.leaked_blocks);
  EXPECT_EQ(u(*pn, "in_use_bytes") - u(*p0, "in_use_bytes"), R * per.leaked_bytes);
  // Its leak's frames name the function: mappings read while it lived.
  EXPECT_TRUE(stack_has(*pn, 33, "leak_here")) << (*pn)["leaks"].dump();

  for (const char* k : {"ringbuf", "stack_ringbuf"})
    EXPECT_EQ(j["dropped"][k].get<long>(), 0) << k << " in " << j["dropped"].dump();
}

// System-wide, a short process often exits before the loader has read its
// /proc/PID/maps (it is never stopped). Its address space is then rebuilt
// from the kernel's records of what it mapped (MT_EV_MAPFILE: the program
// at exec, each library mmap'd with PROT_EXEC): its leak's stack is
// symbolized through the program and libc. MEMTRACE_TEST_UNREADABLE_COMM
// makes the loader take every process of that name for gone before it
// reads it (no maps, no unwind tables: the rows come through its VMAs).
TEST_F(BusyHost, ProcessGoneBeforeItsMapsAreReadIsSymbolized) {
  std::string rep = tmpfile("gone"), rec = tmpfile("gone-rec");
  setenv("MEMTRACE_TEST_UNREADABLE_COMM", "alloc_rounds", 1);
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "5", "--record", rec});
  unsetenv("MEMTRACE_TEST_UNREADABLE_COMM");
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  const long R = 100;
  auto [pid0, out0] = run_known(0);
  auto [pidn, outn] = run_known(R);
  sleep(1);
  json j = stop_tool(m, rep, merr);
  ASSERT_TRUE(j.is_object()) << merr;
  const json& st = j["stats"];
  std::cerr << "mappings_not_captured " << st["mappings_not_captured"] << ", from_kernel "
            << st["mappings_from_kernel"] << ", unresolved " << st["mappings_from_kernel_unresolved"] << "\n";
  // Both runs unread; each: the program (its code segment), ld.so, libc.
  EXPECT_GE(st["mappings_not_captured"].get<long>(), 2);
  EXPECT_GE(st["mappings_from_kernel"].get<long>(), 6);

  PerRound per = parse_per_round(outn);
  const json* p0 = find_proc(j, pid0);
  const json* pn = find_proc(j, pidn);
  ASSERT_TRUE(p0 && pn) << j["processes"].size() << " processes";
  EXPECT_EQ(u(*pn, "allocs") - u(*p0, "allocs"), R * per.allocs);
  EXPECT_EQ(u(*pn, "in_use_bytes") - u(*p0, "in_use_bytes"), R * per.leaked_bytes);
  // Named through the program's own file and through libc's.
  EXPECT_TRUE(stack_has(*pn, 33, "leak_here")) << (*pn)["leaks"].dump();
  EXPECT_TRUE(stack_has(*pn, 33, "main")) << (*pn)["leaks"].dump();
  EXPECT_TRUE(stack_has(*pn, 33, "__libc_start_call_main")) << (*pn)["leaks"].dump();

  // The recording has the rebuilt mappings: replay names the same frames.
  ToolRun rp = run_argv({tool(), "replay", rec, "--format", "json", "--top", "5"});
  unlink(rec.c_str());
  ASSERT_EQ(rp.code, 0) << rp.err;
  json rj = json::parse(rp.out, nullptr, false);
  const json* rn = find_proc(rj, pidn);
  ASSERT_TRUE(rn) << rp.err;
  EXPECT_TRUE(stack_has(*rn, 33, "leak_here")) << (*rn)["leaks"].dump();
  EXPECT_TRUE(stack_has(*rn, 33, "__libc_start_call_main")) << (*rn)["leaks"].dump();
}

namespace {

// The leak group of p with one block of `bytes`, null if none.
const json* leak_of(const json& p, long bytes) {
  for (const auto& l : p["leaks"])
    if (l["blocks"].get<long>() == 1 && l["bytes"].get<long>() == bytes) return &l;
  return nullptr;
}

// Its stack's function names, innermost first ("?" for a frame without one).
std::vector<std::string> functions(const json& leak) {
  std::vector<std::string> out;
  for (const auto& f : leak["stack"]) out.push_back(f.value("function", "?"));
  return out;
}

std::string module_of(const json& leak, const std::string& function) {
  for (const auto& f : leak["stack"])
    if (f.value("function", "") == function) return f.value("module", "");
  return "";
}

// gone_lib_user's leak: gone_lib_inner < gone_lib_outer < main, each in its file.
void expect_gone_lib_leak(const json& p) {
  const json* l = leak_of(p, 4321);
  ASSERT_TRUE(l) << p["leaks"].dump();
  auto fns = functions(*l);
  ASSERT_GE(fns.size(), 3u) << l->dump();
  EXPECT_EQ(fns[0], "gone_lib_inner") << l->dump();
  EXPECT_EQ(fns[1], "gone_lib_outer") << l->dump();
  EXPECT_EQ(fns[2], "main") << l->dump();
  EXPECT_TRUE(module_of(*l, "gone_lib_inner").ends_with("/libmt_gone_inner_with_a_file_name_longer_than_records_keep.so"))
      << l->dump();
  EXPECT_TRUE(module_of(*l, "gone_lib_outer").ends_with("/libmt_gone_outer.so")) << l->dump();
}

}  // namespace

// A process gone unread whose libraries no other process maps (a build's
// cc1 with libisl, libmpc, ...): the kernel's record of each library mmap
// carries the file's own name; the loader looks for it in the program's
// RUNPATH ($ORIGIN here), ld.so.cache's and the default directories, and
// takes a file only if its (dev, inode) are the record's. The inner
// library's name is longer than the record keeps (found by its first 47
// bytes). Live and in replay.
TEST_F(BusyHost, GoneProcessLibrariesAreFoundByNameInItsRunpath) {
  std::string rep = tmpfile("gonelib"), rec = tmpfile("gonelib-rec");
  setenv("MEMTRACE_TEST_UNREADABLE_COMM", "gone_lib_user", 1);
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "5", "--record", rec});
  unsetenv("MEMTRACE_TEST_UNREADABLE_COMM");
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  Child t = spawn({target("gone_lib_user")});
  close(t.in);
  std::string out = read_all(t.out);
  close(t.out);
  close(t.err);
  ASSERT_EQ(wait_exit(t.pid), 0);
  EXPECT_EQ(out, "gone_lib_user " + std::to_string(t.pid) + "\n");
  sleep(1);
  json j = stop_tool(m, rep, merr);
  ASSERT_TRUE(j.is_object()) << merr;
  const json& st = j["stats"];
  std::cerr << "mappings_not_captured " << st["mappings_not_captured"] << ", from_kernel "
            << st["mappings_from_kernel"] << ", unresolved " << st["mappings_from_kernel_unresolved"] << "\n";
  const json* p = find_proc(j, t.pid);
  ASSERT_TRUE(p) << j["processes"].size() << " processes";
  expect_gone_lib_leak(*p);

  ToolRun rp = run_argv({tool(), "replay", rec, "--format", "json", "--top", "5"});
  unlink(rec.c_str());
  ASSERT_EQ(rp.code, 0) << rp.err;
  json rj = json::parse(rp.out, nullptr, false);
  const json* rn = find_proc(rj, t.pid);
  ASSERT_TRUE(rn) << rp.err;
  expect_gone_lib_leak(*rn);
}

namespace {

// The gone_lib libraries copied into a directory of their own (no other
// process maps them, none of the loader's search directories holds them);
// `run` is a shell command line run by /bin/sh with env added, in which
// DIR stands for that directory; comm: its program, taken for gone unread.
// Its output's "COMM PID" line names the process whose leak is checked.
void check_gone_lib_copy(const std::string& comm, const std::string& run, const std::vector<std::string>& env) {
  std::string dir = "/tmp/memtrace-gone-copy-" + std::to_string(getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir + " && mkdir " + dir + " && cp " + target("libmt_gone_outer.so") + " " +
                         target("libmt_gone_inner_with_a_file_name_longer_than_records_keep.so") + " " + dir)
                            .c_str()),
            0);
  auto with_dir = [&](std::string s) {
    for (size_t at; (at = s.find("DIR")) != std::string::npos;) s.replace(at, 3, dir);
    return s;
  };
  std::string rep = tmpfile("gonecopy");
  setenv("MEMTRACE_TEST_UNREADABLE_COMM", comm.c_str(), 1);
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "5"});
  unsetenv("MEMTRACE_TEST_UNREADABLE_COMM");
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  std::vector<std::string> argv = {"/usr/bin/env"};
  for (const auto& e : env) argv.push_back(with_dir(e));
  argv.insert(argv.end(), {"/bin/sh", "-c", with_dir(run)});
  Child t = spawn(argv);
  close(t.in);
  std::string out = read_all(t.out), err = read_all(t.err);
  close(t.out);
  close(t.err);
  ASSERT_EQ(wait_exit(t.pid), 0) << err;
  pid_t pid = 0;
  ASSERT_EQ(sscanf(out.c_str() + std::min(out.size(), out.find(' ') + 1), "%d", &pid), 1) << out;
  sleep(1);
  json j = stop_tool(m, rep, merr);
  std::system(("rm -rf " + dir).c_str());
  ASSERT_TRUE(j.is_object()) << merr;
  const json& st = j["stats"];
  std::cerr << "mappings_not_captured " << st["mappings_not_captured"] << ", from_kernel "
            << st["mappings_from_kernel"] << ", unresolved " << st["mappings_from_kernel_unresolved"] << "\n";
  const json* p = find_proc(j, pid);
  ASSERT_TRUE(p) << j["processes"].size() << " processes";
  expect_gone_lib_leak(*p);
  EXPECT_TRUE(module_of(*leak_of(*p, 4321), "gone_lib_outer").starts_with(dir + "/")) << p->dump();
}

}  // namespace

// The same, the libraries found by the LD_LIBRARY_PATH the program ran
// with (its shell's: read while it waits), the program has no RUNPATH.
TEST_F(BusyHost, GoneProcessLibrariesAreFoundInLdLibraryPath) {
  check_gone_lib_copy("gone_lib_env", target("gone_lib_env") + "; true", {"LD_LIBRARY_PATH=DIR"});
}

// A library the program dlopens by a path (as ld its -plugin: gcc -flto's
// liblto_plugin.so, from a directory of gcc's own): found where a process's
// arguments named it (here the shell's command line; ld's parent collect2
// is given the same arguments as ld).
TEST_F(BusyHost, GoneProcessLibraryLoadedByPathIsFoundByTheArgumentsNamingIt) {
  check_gone_lib_copy("dlopen_path", target("dlopen_path") + " DIR/libmt_gone_outer.so; true", {});
}

// Loaded from the directory of the program (gone unread, named only by the
// kernel's record of its exec), by a path no argument names.
TEST_F(BusyHost, GoneProcessLibraryLoadedFromItsProgramsDirectoryIsFound) {
  check_gone_lib_copy("dlopen_path", "cp " + target("dlopen_path") + " DIR/ && DIR/dlopen_path libmt_gone_outer.so; true",
                      {});
}

namespace {

// fork_exec traced system-wide (unread: the loader takes it for gone before
// each read, MEMTRACE_TEST_UNREADABLE_COMM): each of its three images
// (parent, the forked child before its exec, the child's new program) has
// exactly its own allocations, and keeps one block from a function of its
// own whose stack is named to __libc_start_call_main; no frame unmapped.
void check_fork_exec(bool unread) {
  std::string rep = tmpfile("forkexec");
  if (unread) setenv("MEMTRACE_TEST_UNREADABLE_COMM", "fork_exec", 1);
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "10"});
  unsetenv("MEMTRACE_TEST_UNREADABLE_COMM");
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  Child t = spawn({target("fork_exec")});
  close(t.in);
  std::string out = read_all(t.out);
  close(t.out);
  close(t.err);
  ASSERT_EQ(wait_exit(t.pid), 0);
  pid_t child = 0;
  ASSERT_EQ(sscanf(out.c_str(), "fork_exec child %d", &child), 1) << out;
  sleep(1);
  json j = stop_tool(m, rep, merr);
  ASSERT_TRUE(j.is_object()) << merr;

  struct Want {
    pid_t pid;
    long image;  // exec_index; -1: the pid's last
    long bytes;
    const char* function;
    long allocs, bytes_allocated, in_use_bytes;
  };
  // The parent: its last image (its first is the test's fork that exec'd
  // it); it allocates its block and, after the child, stdout's buffer (a
  // pipe: 4096 bytes). The forked child holds the parent's block too.
  for (const Want& w : {Want{t.pid, -1, 1111, "parent_leak", 2, 1111 + 4096, 1111 + 4096},
                        Want{child, 0, 2222, "child_leak", 1, 2222, 2222 + 1111},
                        Want{child, 1, 3333, "exec_leak", 1, 3333, 3333}}) {
    SCOPED_TRACE(w.function);
    const json* p = w.image < 0 ? find_proc(j, w.pid) : nullptr;
    for (const auto& q : j["processes"])
      if (w.image >= 0 && q["pid"] == w.pid && q["exec_index"] == w.image) p = &q;
    ASSERT_TRUE(p) << "pid " << w.pid << " image " << w.image << " not in the report";
    EXPECT_EQ((*p)["comm"], "fork_exec");
    EXPECT_EQ(u(*p, "allocs"), w.allocs);
    EXPECT_EQ(u(*p, "bytes_allocated"), w.bytes_allocated);
    EXPECT_EQ(u(*p, "in_use_bytes"), w.in_use_bytes);
    const json* l = leak_of(*p, w.bytes);
    ASSERT_TRUE(l) << (*p)["leaks"].dump();
    auto fns = functions(*l);
    ASSERT_GE(fns.size(), 3u) << l->dump();
    EXPECT_EQ(fns[0], w.function) << l->dump();
    EXPECT_EQ(fns[1], "main") << l->dump();
    EXPECT_EQ(fns[2], "__libc_start_call_main") << l->dump();
    for (const auto& lk : (*p)["leaks"])
      for (const auto& f : lk["stack"]) EXPECT_NE(f.value("unknown", ""), "unmapped") << lk.dump();
  }
}

}  // namespace

// System-wide, a fork reaches the loader through the events ring (in order
// with the allocations), the exec of either process through the lifecycle
// ring (drained first): make and sh fork children that allocate once and
// exec. The child's exec read before its fork record stays its image, and
// the image a fork ends is sealed with its parent's mappings.
TEST_F(BusyHost, ForkedChildThatExecsIsSymbolized) { check_fork_exec(false); }

// The same with both processes gone before each read: the mappings come
// from the kernel's records, and an image ended by an exec is sealed only
// once the lifecycle records from before that exec are in (its parent's
// program and libc).
TEST_F(BusyHost, ForkedChildThatExecsIsSymbolizedWhenGoneUnread) { check_fork_exec(true); }

// A container's process gone unread: its program and libraries are files of
// its own root only (a private mount namespace, a tmpfs mounted there with
// copies of alloc_rounds, dash, sleep, libc and ld.so, chroot'ed into); the
// kernel's records name them by their paths there (/app/mt_ct_alloc,
// libc.so.6), which on the host are no file or another one. The loader
// finds them through the root of a live process of the container (its
// shell, which waits for it and then sleeps), as /proc/PID/root/..., the
// (dev, inode) checked: the leak's stack is named. (The shell sleeps first:
// the container's libc, another file than the host's, has its probes once
// the shell is read.)
TEST_F(BusyHost, GoneContainerProcessIsSymbolizedThroughItsRoot) {
  std::string dir = "/tmp/memtrace-ct-" + std::to_string(getpid()), stage = dir + "/stage", root = dir + "/root";
  std::string libc = "/lib/x86_64-linux-gnu/libc.so.6", ld = "/lib64/ld-linux-x86-64.so.2";
  ASSERT_EQ(access(libc.c_str(), R_OK), 0) << "x86-64 Debian layout expected";
  std::string setup = "rm -rf " + dir + " && mkdir -p " + root + " " + stage + "/app " + stage + "/bin " + stage +
                      "/lib/x86_64-linux-gnu " + stage + "/lib64 && cp " + target("alloc_rounds") + " " + stage +
                      "/app/mt_ct_alloc && cp /bin/dash " + stage + "/bin/sh && cp /bin/sleep " + stage +
                      "/bin/sleep && cp " + libc + " " + stage + libc + " && cp " + ld + " " + stage + ld;
  ASSERT_EQ(std::system(setup.c_str()), 0) << setup;
  std::string rep = tmpfile("container");
  setenv("MEMTRACE_TEST_UNREADABLE_COMM", "mt_ct_alloc", 1);
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--top", "5"});
  unsetenv("MEMTRACE_TEST_UNREADABLE_COMM");
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "tracing", &merr)) << merr;
  Child t = spawn({"/usr/bin/unshare", "-m", "--propagation", "private", "--fork", "/bin/sh", "-c",
                   "mount -t tmpfs mt-ct " + root + " && cp -a " + stage + "/. " + root + " && exec /usr/sbin/chroot " +
                       root + " /bin/sh -c '/bin/sleep 1; /app/mt_ct_alloc --rounds 3; /bin/sleep 1'"});
  close(t.in);
  std::string out = read_all(t.out), err = read_all(t.err);
  close(t.out);
  close(t.err);
  ASSERT_EQ(wait_exit(t.pid), 0) << err;
  EXPECT_NE(out.find("per_round allocs="), std::string::npos) << out << err;
  sleep(1);
  json j = stop_tool(m, rep, merr);
  std::system(("rm -rf " + dir).c_str());
  ASSERT_TRUE(j.is_object()) << merr;
  const json& st = j["stats"];
  std::cerr << "mappings_not_captured " << st["mappings_not_captured"] << ", from_kernel "
            << st["mappings_from_kernel"] << ", unresolved " << st["mappings_from_kernel_unresolved"] << "\n";
  const json* p = nullptr;
  for (const auto& q : j["processes"])
    if (q["comm"] == "mt_ct_alloc") p = &q;
  ASSERT_TRUE(p) << j["processes"].size() << " processes";
  // Named through the container's copies: the 3 rounds' blocks of 33 bytes.
  const json* l = nullptr;
  for (const auto& lk : (*p)["leaks"])
    if (lk["bytes"].get<long>() == 33 * lk["blocks"].get<long>() && lk["blocks"].get<long>() == 3) l = &lk;
  ASSERT_TRUE(l) << p->dump();
  auto fns = functions(*l);
  ASSERT_GE(fns.size(), 3u) << l->dump();
  EXPECT_EQ(fns[0], "leak_here") << l->dump();
  EXPECT_TRUE(std::find(fns.begin(), fns.end(), "main") != fns.end()) << l->dump();
  EXPECT_TRUE(std::find(fns.begin(), fns.end(), "__libc_start_call_main") != fns.end()) << l->dump();
  std::string prog = module_of(*l, "leak_here"), lc = module_of(*l, "__libc_start_call_main");
  EXPECT_TRUE(prog.starts_with("/proc/") && prog.ends_with("/root/app/mt_ct_alloc")) << prog;
  EXPECT_TRUE(lc.starts_with("/proc/") && lc.ends_with("/root" + libc)) << lc;
}
