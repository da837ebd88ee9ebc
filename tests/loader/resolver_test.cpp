// The resolver's images of a process system-wide (src/loader/resolver.h):
// a fork comes from the events ring, the execs of the child and of the
// parent from the lifecycle ring, often first. Real mappings (this test
// program's), made-up pids and times.
#include <gtest/gtest.h>
#include <unistd.h>

#include "loader/resolver.h"
#include "procfs/proc_maps.h"

using memtrace::heap::Process;
using memtrace::loader::Resolver;
namespace procfs = memtrace::procfs;

namespace {

// This process's executable mappings: all of them, and libc's alone.
struct Maps {
  std::vector<procfs::Mapping> all, libc;
  Maps() {
    auto r = procfs::read_maps(getpid());
    if (!r) return;
    for (const auto& m : *r) {
      if (!m.exec() || !m.file()) continue;
      all.push_back(m);
      if (m.path.find("/libc.so") != std::string::npos) libc.push_back(m);
    }
  }
};

size_t ranges(Resolver& r, pid_t pid, uint64_t exec_ts) {
  Process p;
  p.pid = pid;
  p.exec_ts = exec_ts;
  return r.map_of(p).ranges.size();
}

}  // namespace

// The child's exec read before its fork record: the fork does not replace
// that image; the child's image before its exec is its parent's space.
TEST(Resolver, ForkRecordAfterTheChildsExecKeepsTheExecsImage) {
  Maps m;
  ASSERT_FALSE(m.libc.empty());
  ASSERT_GT(m.all.size(), m.libc.size());
  Resolver r({});
  const pid_t parent = 900001, child = 900002;
  r.exec(parent, 100, &m.all);
  r.exec(child, 300, &m.libc);  // lifecycle ring: the child's exec, read
  r.forked(parent, child, 200);  // events ring: the fork, later
  EXPECT_EQ(ranges(r, child, 300), m.libc.size());  // its program's own
  EXPECT_EQ(ranges(r, child, 0), ranges(r, parent, 100));  // before the exec: the parent's
  EXPECT_EQ(ranges(r, parent, 100), m.all.size());
}

// The parent exec'd right after the fork, and that exec was read first:
// the child's addresses are the parent's image's at the fork, not the new one's.
TEST(Resolver, ForkLinksTheParentsImageAtTheFork) {
  Maps m;
  ASSERT_FALSE(m.libc.empty());
  Resolver r({});
  const pid_t parent = 900011, child = 900012;
  r.exec(parent, 100, &m.all);
  r.exec(parent, 300, &m.libc);  // its next exec, read before the fork record
  r.forked(parent, child, 200);
  EXPECT_EQ(ranges(r, child, 0), m.all.size());
}

// A pid seen before the fork belonged to a process that is gone: its
// images go.
TEST(Resolver, ForkOfAReusedPidStartsAfresh) {
  Maps m;
  ASSERT_FALSE(m.libc.empty());
  Resolver r({});
  const pid_t parent = 900021, child = 900022;
  r.exec(child, 50, &m.libc);  // the pid's previous process
  r.exec(parent, 100, &m.all);
  r.forked(parent, child, 200);
  EXPECT_EQ(ranges(r, child, 0), m.all.size());
  EXPECT_EQ(ranges(r, child, 50), m.all.size());  // no image of the old process left
}
