// `memtrace-bpf diff A B`: what grew and what shrank between two recordings
// (--record FILE) or two JSON reports (-o x.json), by symbolized stack
// (report/diff.h). Built into the memtrace-bpf executable (CLI11).
#pragma once

namespace memtrace::loader {

// argv[0] is "diff". Returns the exit code: 0; 1 when a recording is cut
// short (what was read is compared); 2 for bad input (one line on stderr).
int run_diff(int argc, char** argv);

}  // namespace memtrace::loader
