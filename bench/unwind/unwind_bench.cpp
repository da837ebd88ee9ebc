// unwind_bench [--fp] -- CMD...: trace every malloc of CMD with the BPF
// unwinder (tests/unwind harness: mt_capture_stack of bpf/stack.bpf.h) and
// print one JSON line: allocations, distinct stacks, the share of allocation
// stacks that reach main (a frame in __libc_start_call_main, i.e. main's
// caller) or a thread start routine (start_thread), the share that ended at
// an outermost frame (_start / clone3), table memory, and the BPF program's
// average run time (kernel.bpf_stats_enabled). --fp: frame pointers only.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "harness.h"

using namespace memtrace::unwind;

int main(int argc, char** argv) {
  harness::Options opt;
  opt.timeout_ms = 600000;
  std::vector<std::string> cmd;
  int i = 1;
  for (; i < argc; i++) {
    if (!std::strcmp(argv[i], "--fp")) opt.unwind = false;
    else if (!std::strcmp(argv[i], "--")) { i++; break; }
    else break;
  }
  for (; i < argc; i++) cmd.push_back(argv[i]);
  if (cmd.empty()) {
    std::fprintf(stderr, "usage: unwind_bench [--fp] -- CMD...\n");
    return 2;
  }
  auto run = harness::trace(cmd, opt);
  if (!run) {
    std::fprintf(stderr, "%s\n", run.error().message.c_str());
    return 1;
  }
  harness::Symbolizer sym(run->maps);
  // "sh -c 'exec \"$0\" ...' PROG ARGS": name PROG.
  std::string label = cmd.size() > 3 && cmd[0] == "sh" ? cmd[3] : cmd[0];
  uint64_t total = 0, reach = 0, truncated = 0;
  for (auto& s : run->stacks) {
    total += s.count;
    if (s.flags & MT_F_STACK_TRUNCATED) truncated += s.count;
    bool r = false;
    for (auto ip : s.ips) {
      for (auto& a : sym.aliases(ip))
        r |= a == "__libc_start_call_main" || a == "start_thread";
      if (r) break;
    }
    if (r) reach += s.count;
  }
  const uint64_t* c = run->counters;
  auto pct = [](uint64_t a, uint64_t b) { return b ? 100.0 * double(a) / double(b) : 0.0; };
  const auto& ts = run->table_stats;
  std::printf("{\"cmd\": \"%s\", \"mode\": \"%s\", \"allocations\": %lu, \"distinct_stacks\": %zu, "
              "\"reach_main_or_thread_start_pct\": %.2f, \"outermost_pct\": %.2f, \"truncated_pct\": %.2f, "
              "\"trunc_depth\": %lu, \"trunc_no_table\": %lu, \"trunc_unsupported\": %lu, \"trunc_read\": %lu, "
              "\"trunc_bad_frame\": %lu, \"frames_cfi\": %lu, \"frames_fp\": %lu, "
              "\"table_files\": %zu, \"table_rows\": %zu, \"table_bytes\": %zu, \"mappings\": %zu, "
              "\"mappings_no_cfi\": %zu, \"prog_ns_per_call\": %.0f, \"table_errors\": \"%s\"}\n",
              label.c_str(), opt.unwind ? "cfi" : "fp", (unsigned long)total, run->stacks.size(),
              pct(reach, total), pct(c[MT_UC_END_OUTERMOST], c[MT_UC_STACKS]), pct(truncated, total),
              (unsigned long)c[MT_UC_TRUNC_DEPTH], (unsigned long)c[MT_UC_TRUNC_NO_TABLE],
              (unsigned long)c[MT_UC_TRUNC_UNSUPPORTED], (unsigned long)c[MT_UC_TRUNC_READ],
              (unsigned long)c[MT_UC_TRUNC_BAD_FRAME], (unsigned long)c[MT_UC_FRAMES_CFI],
              (unsigned long)c[MT_UC_FRAMES_FP], ts.files, ts.rows, ts.row_bytes, ts.mappings,
              ts.mappings_no_cfi,
              run->prog_run_cnt ? double(run->prog_run_ns) / double(run->prog_run_cnt) : 0.0,
              run->table_errors.empty() ? "" : "see stderr");
  if (!run->table_errors.empty()) std::fprintf(stderr, "%s", run->table_errors.c_str());
  return 0;
}
