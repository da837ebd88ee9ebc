// The resolver's look-up of a gone process's library in its parent's
// LD_LIBRARY_PATH (read at the look-up, once per parent process): a parent
// pid used again by another process is that process, read again. Run in a
// pid namespace of its own (unshare -p -f --mount-proc, CMakeLists.txt),
// where ns_last_pid makes the second parent get the first one's pid.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "loader/resolver.h"
#include "test_env.h"

using namespace memtrace;

namespace {

// A process with pid `want` (this pid namespace is the test's own: nothing
// else forks in it) running sleep with LD_LIBRARY_PATH=dir.
pid_t parent_with(pid_t want, const std::string& dir) {
  std::ofstream("/proc/sys/kernel/ns_last_pid") << want - 1;
  pid_t p = fork();
  if (p == 0) {
    std::string env = "LD_LIBRARY_PATH=" + dir;
    char* envp[] = {env.data(), nullptr};
    execle("/bin/sleep", "sleep", "60", static_cast<char*>(nullptr), envp);
    _exit(127);
  }
  // Until it has exec'd (its environ is sleep's).
  for (int i = 0; i < 500; i++) {
    std::ifstream f("/proc/" + std::to_string(p) + "/environ");
    std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (s.starts_with("LD_LIBRARY_PATH=")) break;
    usleep(2000);
  }
  return p;
}

// The kernel's record of libmt_reuse.so mapped by a gone child of parent,
// the copy in dir: found (mappings_from_kernel grows) or not.
loader::KernelMapping record_of(const std::string& dir) {
  struct stat st {};
  EXPECT_EQ(stat((dir + "/libmt_reuse.so").c_str(), &st), 0);
  loader::KernelMapping k;
  k.start = 0x7f0000000000;
  k.end = k.start + 0x1000;
  k.dev = st.st_dev;
  k.inode = st.st_ino;
  k.path = "libmt_reuse.so";
  return k;
}

}  // namespace

TEST(ResolverReuse, ParentPidUsedAgainIsReadAgain) {
  MEMTRACE_REQUIRE_ROOT();
  if (getpid() != 1) MEMTRACE_SKIP_OR_FAIL("not in a pid namespace of its own (run by ctest: unshare -p -f)");
  std::string base = "/tmp/memtrace-reuse-" + std::to_string(getpid()) + "-" + std::to_string(time(nullptr));
  ASSERT_EQ(std::system(("mkdir -p " + base + "/a " + base + "/b && cp /bin/true " + base +
                         "/a/libmt_reuse.so && cp /bin/true " + base + "/b/libmt_reuse.so").c_str()),
            0);
  loader::Resolver r(symbolize::Options{});
  const pid_t P = 300;
  // The first parent (LD_LIBRARY_PATH: a) and its gone child 1000.
  pid_t p1 = parent_with(P, base + "/a");
  ASSERT_EQ(p1, P);
  r.forked(P, 1000, 1);
  r.unreadable(1000, 0);
  r.kernel_mapped(1000, record_of(base + "/a"));
  EXPECT_EQ(r.kernel_given(), 1u);
  kill(p1, SIGKILL);
  waitpid(p1, nullptr, 0);
  usleep(30000);  // another start time (clock ticks)
  // Another process with its pid (LD_LIBRARY_PATH: b), its gone child 1001.
  pid_t p2 = parent_with(P, base + "/b");
  ASSERT_EQ(p2, P);
  r.forked(P, 1001, 2);
  r.unreadable(1001, 0);
  r.kernel_mapped(1001, record_of(base + "/b"));
  EXPECT_EQ(r.kernel_given(), 2u) << "the second parent's LD_LIBRARY_PATH was not read";
  EXPECT_EQ(r.kernel_unresolved(), 0u);
  kill(p2, SIGKILL);
  waitpid(p2, nullptr, 0);
  std::system(("rm -rf " + base).c_str());
}
