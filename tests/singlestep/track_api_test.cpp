// The memtrace_track C API, run from inside a program (ss_track_api_target).
#include <cstdio>
#include <string>

#include "test_env.h"

#ifdef SS_API_TARGET
TEST(TrackApi, TracksOwnRegionExactly) {
  MEMTRACE_REQUIRE_ROOT();
  FILE* p = popen(SS_API_TARGET " 2>&1", "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  int st = pclose(p);
  EXPECT_EQ(st, 0) << out;
  EXPECT_NE(out.find("num_access 13 PASS"), std::string::npos) << out;
  EXPECT_NE(out.find("access 13 times"), std::string::npos) << out;
}
#endif
