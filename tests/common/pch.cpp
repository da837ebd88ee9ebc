// The test programs' shared precompiled header is built with this file
// (tests/CMakeLists.txt: memtrace_test_pch).
