// The perf map parser (src/symbolize/perf_map.h): lines, growth, bad lines.
#include "symbolize/perf_map.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

using memtrace::symbolize::PerfMap;
using memtrace::symbolize::PerfMapFile;

TEST(PerfMap, ParsesStartSizeAndNameWithSpaces) {
  PerfMap m;
  m.feed("3ef414c0 398 LazyCompile:~keep app.js:3\n0x7f00aa000000 0x40 JS:*foo bar baz\n");
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m.bad_lines(), 0u);
  ASSERT_TRUE(m.find(0x3ef414c0));
  EXPECT_EQ(m.find(0x3ef414c0)->name, "LazyCompile:~keep app.js:3");
  EXPECT_EQ(m.find(0x3ef414c0 + 0x397)->name, "LazyCompile:~keep app.js:3");
  EXPECT_EQ(m.find(0x3ef414c0 + 0x398), nullptr);  // one past the end
  EXPECT_EQ(m.find(0x3ef414bf), nullptr);
  ASSERT_TRUE(m.find(0x7f00aa00003f));
  EXPECT_EQ(m.find(0x7f00aa00003f)->name, "JS:*foo bar baz");
}

TEST(PerfMap, BadLinesAreCountedNotFatal) {
  PerfMap m;
  m.feed("garbage\n10 zz name\n20 8\n30 0 empty\n\n40 8 good\nffffffffffffffff 10 wraps\n50 8 also good\r\n");
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m.bad_lines(), 5u);
  EXPECT_EQ(m.lines(), 7u);
  ASSERT_TRUE(m.find(0x44));
  EXPECT_EQ(m.find(0x44)->name, "good");
  ASSERT_TRUE(m.find(0x50));
  EXPECT_EQ(m.find(0x50)->name, "also good");  // CR LF
}

TEST(PerfMap, LineSplitAcrossFeedsWaitsForItsEnd) {
  PerfMap m;
  m.feed("100 10 fir");
  EXPECT_EQ(m.size(), 0u);
  m.feed("st\n200 1");
  EXPECT_EQ(m.size(), 1u);
  EXPECT_EQ(m.find(0x105)->name, "first");
  m.feed("0 second\n");
  ASSERT_TRUE(m.find(0x20f));
  EXPECT_EQ(m.find(0x20f)->name, "second");
  m.feed("300 10 unterminated");
  EXPECT_EQ(m.find(0x300), nullptr);
  m.finish();
  ASSERT_TRUE(m.find(0x300));
  EXPECT_EQ(m.find(0x300)->name, "unterminated");
}

TEST(PerfMap, CodeMadeAgainAtAnAddressTakesTheNewerName) {
  PerfMap m;
  m.feed("1000 100 old\n1000 40 new\n");
  EXPECT_EQ(m.find(0x1010)->name, "new");
  EXPECT_EQ(m.find(0x1050), nullptr);  // the old piece is gone with it
  // A long piece below a short one still covers past it.
  m.feed("2000 1000 outer\n2100 10 inner\n");
  EXPECT_EQ(m.find(0x2105)->name, "inner");
  EXPECT_EQ(m.find(0x2200)->name, "outer");
}

TEST(PerfMapFile, ReadsWhatWasAppendedAndStartsAgainWhenTheFileShrinks) {
  std::string path = "/tmp/memtrace-perfmap-test-" + std::to_string(getpid()) + ".map";
  unlink(path.c_str());
  PerfMapFile f(path);
  EXPECT_FALSE(f.refresh());  // not there yet
  EXPECT_FALSE(f.found());
  {
    std::ofstream o(path);
    o << "1000 10 a\n2000 10 b";  // the last line not finished yet
  }
  EXPECT_TRUE(f.refresh());
  EXPECT_TRUE(f.found());
  EXPECT_EQ(f.map().size(), 1u);
  EXPECT_FALSE(f.refresh());  // nothing new
  {
    std::ofstream o(path, std::ios::app);
    o << "\nzzz\n3000 10 c\n";
  }
  EXPECT_TRUE(f.refresh());
  EXPECT_EQ(f.map().size(), 3u);
  EXPECT_EQ(f.map().bad_lines(), 1u);
  EXPECT_EQ(f.map().find(0x2005)->name, "b");
  EXPECT_EQ(f.text(), "1000 10 a\n2000 10 b\nzzz\n3000 10 c\n");
  {
    std::ofstream o(path, std::ios::trunc);  // the same file, rewritten shorter
    o << "4000 10 d\n";
  }
  EXPECT_TRUE(f.refresh());
  EXPECT_EQ(f.map().size(), 1u);
  EXPECT_EQ(f.map().find(0x1005), nullptr);
  EXPECT_EQ(f.map().find(0x4005)->name, "d");
  unlink(path.c_str());
  // Opened once, it stays readable after its path is gone.
  EXPECT_FALSE(f.refresh());
  EXPECT_EQ(f.map().find(0x4005)->name, "d");
}
