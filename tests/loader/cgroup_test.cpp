// --cgroup PATH (issue 34): the processes of a cgroup v2 subtree, those in it
// at the start (attached) and those started in it later (BPF's exec filter
// on the cgroup id), counted exactly; a process outside it is not traced.
// And the container ids runtimes put in cgroup names.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "../metrics/scrape.h"
#include "harness.h"
#include "slurp.h"
#include "procfs/cgroup.h"
#include "test_env.h"

using namespace memtrace::testing;
using nlohmann::json;
namespace pf = memtrace::procfs;

namespace {

TEST(Cgroup, ContainerIdsFromTheRuntimesCgroupNames) {
  const std::string id(64, 'a');
  struct Case {
    std::string path, id, runtime, pod;
  } cases[] = {
      {"/system.slice/docker-" + id + ".scope", id, "docker", ""},
      {"/docker/" + id, id, "docker", ""},
      {"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_0000_1111_2222_333344445555.slice/"
       "cri-containerd-" + id + ".scope",
       id, "containerd", "1b2c3d4e-0000-1111-2222-333344445555"},
      {"/kubepods/besteffort/pod1b2c3d4e-0000-1111-2222-333344445555/" + id, id, "containerd",
       "1b2c3d4e-0000-1111-2222-333344445555"},
      {"/kubepods.slice/kubepods-pod1b2c3d4e_0000_1111_2222_333344445555.slice/crio-" + id + ".scope", id, "cri-o",
       "1b2c3d4e-0000-1111-2222-333344445555"},
      {"/machine.slice/libpod-" + id + ".scope/container", id, "podman", ""},
      {"/user.slice/user-1000.slice/session-2.scope", "", "", ""},
      {"/", "", "", ""},
  };
  for (const auto& c : cases) {
    pf::Container got = pf::container_of(c.path);
    EXPECT_EQ(got.id, c.id) << c.path;
    EXPECT_EQ(got.runtime, c.runtime) << c.path;
    EXPECT_EQ(got.pod, c.pod) << c.path;
  }
  EXPECT_TRUE(pf::cgroup_within("/a/b", "/a"));
  EXPECT_TRUE(pf::cgroup_within("/a", "/a"));
  EXPECT_FALSE(pf::cgroup_within("/ab", "/a"));
  EXPECT_TRUE(pf::cgroup_within("/x", "/"));
}

TEST(Cgroup, NotACgroupDirectoryIsOneLineAndExitTwo) {
  ToolRun r = run_argv({tool(), "--cgroup", "/nonexistent-cgroup-dir", "--duration", "1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--cgroup /nonexistent-cgroup-dir"), std::string::npos) << r.err;
}

class CgroupTracing : public ::testing::Test {
 protected:
  std::string dir, rel;
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    std::string mnt = pf::cgroup2_mount();
    if (mnt.empty()) MEMTRACE_SKIP_OR_FAIL("no cgroup2 file system mounted");
    rel = "/memtrace-test-" + std::to_string(getpid());
    dir = mnt + rel;
    if (mkdir(dir.c_str(), 0755) != 0) MEMTRACE_SKIP_OR_FAIL("cannot make a cgroup: " + dir);
  }
  void TearDown() override {
    if (!dir.empty()) rmdir(dir.c_str());
  }
  // argv run by a shell that first moves itself into the cgroup.
  std::vector<std::string> in_cgroup(const std::vector<std::string>& argv) {
    std::string cmd = "echo $$ > " + dir + "/cgroup.procs && exec";
    for (const auto& a : argv) cmd += " " + a;
    return {"/bin/sh", "-c", cmd};
  }
};

TEST_F(CgroupTracing, TracesItsProcessesAndThoseStartedInItLaterExactly) {
  const long R = 30;
  // In the cgroup before the tool: attached at the start.
  Child before = spawn(in_cgroup({target("alloc_rounds"), "--rounds", std::to_string(R), "--wait"}));
  std::string bo;
  ASSERT_TRUE(read_until(before.out, "ready", &bo)) << bo;
  std::string rep = tmpfile("cg");
  Child m = spawn({tool(), "--format", "json", "-o", rep, "--cgroup", dir});
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "Ctrl-C", &merr)) << merr;
  EXPECT_NE(merr.find("cgroup " + rel), std::string::npos) << merr;
  // Started in it later: at their exec, from their first allocation.
  auto run_in = [&](long rounds) {
    Child c = spawn(in_cgroup({target("alloc_rounds"), "--rounds", std::to_string(rounds)}));
    close(c.in);
    std::string o = read_all(c.out);
    EXPECT_EQ(wait_exit(c.pid), 0);
    return std::make_pair(c.pid, o);
  };
  auto [p0, o0] = run_in(0);
  auto [p1, o1] = run_in(R);
  // Outside it: not traced.
  Child other = spawn({target("alloc_rounds"), "--rounds", "3"});
  close(other.in);
  read_all(other.out);
  wait_exit(other.pid);
  // The one from before: its rounds now, then its exit.
  ASSERT_EQ(write(before.in, "\n", 1), 1);
  std::string more;
  ASSERT_TRUE(read_until(before.out, "per_round", &more)) << more;  // its rounds done; it waits again
  ASSERT_EQ(write(before.in, "\n", 1), 1);
  close(before.in);
  read_all(before.out);
  ASSERT_EQ(wait_exit(before.pid), 0);
  usleep(300 * 1000);
  kill(m.pid, SIGINT);
  EXPECT_EQ(wait_exit(m.pid), 0) << merr;
  std::ifstream f(rep);
  json j = json::parse(f, nullptr, false);
  unlink(rep.c_str());
  ASSERT_TRUE(j.is_object());
  PerRound per = parse_per_round(o1);
  const json* a = find_proc(j, p0);
  const json* b = find_proc(j, p1);
  const json* c = find_proc(j, before.pid);
  ASSERT_TRUE(a && b && c) << j.dump().substr(0, 3000);
  EXPECT_EQ(find_proc(j, other.pid), nullptr);
  EXPECT_EQ(u(*b, "allocs") - u(*a, "allocs"), R * per.allocs);
  EXPECT_EQ(u(*b, "frees") - u(*a, "frees"), R * per.frees);
  EXPECT_EQ(u(*b, "bytes_allocated") - u(*a, "bytes_allocated"), R * per.bytes);
  // Attached while it waited: every round's calls are seen (its start-up's are not).
  EXPECT_GE(u(*c, "allocs"), R * per.allocs);
  EXPECT_GE(u(*c, "bytes_allocated"), R * per.bytes);
}

// Every output names a process's cgroup and the container a runtime's
// cgroup name gives (docker's "docker-<64 hex>.scope" leaf): JSON, text,
// pprof labels (read by Go's pprof), Prometheus labels, HTML and the replay
// of the recording.
TEST_F(CgroupTracing, EveryOutputLabelsItsProcessesWithCgroupAndContainer) {
  char hex[65];
  snprintf(hex, sizeof hex, "%016x%016x%016x%016x", 0x5eedu, unsigned(getpid()), 0xc0ffeeu, 0x1234u);
  const std::string id = hex;
  const std::string leaf_rel = rel + "/docker-" + id + ".scope";
  const std::string leaf = dir + "/docker-" + id + ".scope";
  ASSERT_EQ(mkdir(leaf.c_str(), 0755), 0) << leaf;
  struct Rm {
    std::string d;
    ~Rm() { rmdir(d.c_str()); }
  } rm{leaf};
  const long R = 20;
  std::string cmd = "echo $$ > " + leaf + "/cgroup.procs && exec " + target("alloc_rounds") + " --rounds " +
                    std::to_string(R) + " --wait";
  Child t = spawn({"/bin/sh", "-c", cmd});
  std::string to;
  ASSERT_TRUE(read_until(t.out, "ready", &to)) << to;
  std::string base = tmpfile("cgl");
  Child m = spawn({tool(), "--cgroup", dir, "--metrics", "127.0.0.1:0", "-o", base + ".json", "-o", base + ".txt",
                   "-o", base + ".pb.gz", "-o", base + ".html", "--record", base + ".rec"});
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "Ctrl-C", &merr)) << merr;
  std::smatch mm;
  ASSERT_TRUE(std::regex_search(merr, mm, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) << merr;
  uint16_t port = static_cast<uint16_t>(std::stoi(mm[1]));
  // Its rounds, then a scrape while it waits again.
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  ASSERT_TRUE(read_until(t.out, "per_round", &to)) << to;
  usleep(500 * 1000);
  HttpReply scrape = http_get(port, "/metrics");
  ASSERT_EQ(scrape.status, 200);
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  close(t.in);
  read_all(t.out);
  ASSERT_EQ(wait_exit(t.pid), 0);
  usleep(300 * 1000);
  kill(m.pid, SIGINT);
  EXPECT_EQ(wait_exit(m.pid), 0) << merr;
  std::string pid = std::to_string(t.pid);
  // Prometheus: its series carry both labels.
  std::string want_labels = "pid=\"" + pid + "\",comm=\"alloc_rounds\",cgroup=\"" + leaf_rel +
                            "\",container_id=\"" + id + "\"";
  EXPECT_NE(scrape.body.find("memtrace_heap_in_use_bytes{" + want_labels + "}"), std::string::npos)
      << want_labels << "\n" << scrape.body.substr(0, 3000);
  // JSON
  json j = json::parse(slurp(base + ".json"), nullptr, false);
  const json* p = find_proc(j, t.pid);
  ASSERT_TRUE(p) << j.dump().substr(0, 3000);
  EXPECT_EQ((*p)["cgroup"], leaf_rel);
  EXPECT_EQ((*p)["container"]["id"], id);
  EXPECT_EQ((*p)["container"]["runtime"], "docker");
  EXPECT_TRUE((*p)["container"]["pod"].is_null());
  // text
  std::string txt = slurp(base + ".txt");
  EXPECT_NE(txt.find("    container: docker " + id.substr(0, 12) + ", cgroup " + leaf_rel + "\n"), std::string::npos)
      << txt.substr(0, 2000);
  // HTML: the page's data
  std::string html = slurp(base + ".html");
  EXPECT_NE(html.find("\"cgroup\":\"" + leaf_rel + "\""), std::string::npos);
  EXPECT_NE(html.find("\"id\":\"" + id + "\""), std::string::npos);
  // pprof, read by Go's pprof: every sample labelled.
  if (go_binary().empty()) {
    ADD_FAILURE() << "no Go toolchain for `go tool pprof` (Debian golang-go)";
  } else {
    ToolRun tags = run_argv({go_binary(), "tool", "pprof", "-tags", base + ".pb.gz"});
    EXPECT_NE(tags.out.find(id), std::string::npos) << tags.out << tags.err;
    EXPECT_NE(tags.out.find(leaf_rel), std::string::npos) << tags.out;
    EXPECT_NE(tags.out.find("container_id"), std::string::npos) << tags.out;
  }
  // replay of the recording: the same labels.
  ToolRun rp = run_argv({tool(), "replay", base + ".rec", "--format", "json"});
  ASSERT_EQ(rp.code, 0) << rp.err;
  json jr = json::parse(rp.out, nullptr, false);
  const json* q = find_proc(jr, t.pid);
  ASSERT_TRUE(q) << rp.out.substr(0, 2000);
  EXPECT_EQ((*q)["cgroup"], leaf_rel);
  EXPECT_EQ((*q)["container"]["id"], id);
  for (const char* ext : {".json", ".txt", ".pb.gz", ".html", ".rec"}) unlink((base + ext).c_str());
}

}  // namespace

// The tool inside a privileged container with the host's pid namespace: its
// own root (a directory holding only its static binary, /proc, /sys and /dev
// bound in, a mount namespace of its own, as `docker run --privileged
// --pid=host` gives), tracing a host process by -p and one started later by
// -c: exact counts, and stacks named from the host's files, which it reads
// through /proc/PID/root (the paths in the host's maps are not in its root).
class Container : public ::testing::Test {
 protected:
  void SetUp() override {
    MEMTRACE_REQUIRE_ROOT();
    if (access("/sys/kernel/btf/vmlinux", R_OK) != 0) MEMTRACE_SKIP_OR_FAIL("no BTF: BPF CO-RE unavailable");
    root = tmpfile("ctr");
    ASSERT_EQ(mkdir(root.c_str(), 0755), 0);
    for (const char* d : {"/proc", "/sys", "/dev", "/tmp"}) ASSERT_EQ(mkdir((root + d).c_str(), 0755), 0);
    ASSERT_EQ(run_argv({"/bin/cp", tool(), root + "/memtrace-bpf"}).code, 0);
    // a static binary: nothing of the host's libraries in the container
    ASSERT_EQ(run_argv({"/bin/sh", "-c", "readelf -l " + root + "/memtrace-bpf | grep -q INTERP"}).code, 1)
        << "memtrace-bpf is not statically linked";
  }
  void TearDown() override {
    if (!root.empty()) run_argv({"/bin/rm", "-rf", root});
  }
  // argv of the tool in the container (the mounts go with its namespace)
  std::vector<std::string> in_container(const std::string& args) {
    return {"/usr/bin/unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
            "mount --bind /proc " + root + "/proc && mount --rbind /sys " + root + "/sys && mount --bind /dev " + root +
                "/dev && exec chroot " + root + " /memtrace-bpf " + args};
  }
  std::string root;
};

TEST_F(Container, ToolInAPrivilegedContainerTracesHostProcessesExactly) {
  const long R = 20;
  Child t = spawn({target("alloc_rounds"), "--wait", "--rounds", std::to_string(R)});
  std::string to;
  ASSERT_TRUE(read_until(t.out, "ready", &to)) << to;
  Child m = spawn(in_container("-p " + std::to_string(t.pid) + " -c mt_comm_target --format json -o /tmp/r.json"));
  std::string merr;
  ASSERT_TRUE(read_until(m.err, "Ctrl-C", &merr)) << merr;
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  ASSERT_TRUE(read_until(t.out, "per_round", &to)) << to;
  PerRound per = parse_per_round(to);
  // and host processes started now, taken at their exec by name: one with
  // no rounds (its start-up's calls) and one with three
  Child l0 = spawn({target("mt_comm_target"), "--rounds", "0"});
  close(l0.in);
  read_all(l0.out);
  ASSERT_EQ(wait_exit(l0.pid), 0);
  Child l3 = spawn({target("mt_comm_target"), "--rounds", "3"});
  close(l3.in);
  PerRound lper = parse_per_round(read_all(l3.out));
  ASSERT_EQ(wait_exit(l3.pid), 0);
  ASSERT_EQ(write(t.in, "\n", 1), 1);
  close(t.in);
  read_all(t.out);
  ASSERT_EQ(wait_exit(t.pid), 0);
  usleep(300 * 1000);
  kill(m.pid, SIGINT);
  merr += read_all(m.err);
  ASSERT_EQ(wait_exit(m.pid), 0) << merr;
  std::string rep = slurp(root + "/tmp/r.json");
  json j = json::parse(rep, nullptr, false);
  const json* p = find_proc(j, t.pid);
  ASSERT_TRUE(p) << rep.substr(0, 2000) << merr;
  EXPECT_EQ((*p)["summary"]["allocs"], R * per.allocs);
  EXPECT_EQ((*p)["summary"]["in_use_blocks"], R * per.leaked_blocks);
  bool named = false;
  for (const auto& g : p->value("leaks", json::array()))
    for (const auto& fr : g["stack"])
      named = named || (fr.value("function", "") == "leak_here" && fr.value("file", "").find("alloc_rounds.c") !=
                                                                        std::string::npos && fr.value("line", 0) > 0);
  EXPECT_TRUE(named) << p->dump().substr(0, 3000);
  const json* q0 = find_proc(j, l0.pid);
  const json* q3 = find_proc(j, l3.pid);
  ASSERT_TRUE(q0 && q3) << rep.substr(0, 2000);
  EXPECT_EQ((*q3)["summary"]["allocs"].get<long>() - (*q0)["summary"]["allocs"].get<long>(), 3 * lper.allocs);
  EXPECT_EQ((*q3)["summary"]["bytes_allocated"].get<long>() - (*q0)["summary"]["bytes_allocated"].get<long>(),
            3 * lper.bytes);
}
