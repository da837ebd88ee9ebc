// unwind_bench [--fp] -- CMD...: trace every malloc of CMD with the BPF
// unwinder (tests/unwind harness: mt_capture_stack of bpf/stack.bpf.h) and
// print one JSON line: allocations, distinct stacks, the share of allocation
// stacks that reach main (a frame in __libc_start_call_main, i.e. main's
// caller) or a thread start routine (start_thread), the share that ended at
// an outermost frame (_start / clone3), table memory, and the BPF program's
// average run time (kernel.bpf_stats_enabled). --fp: frame pointers only.
//
// --gdb N: also run CMD under gdb (no ASLR, as the traced run), take N
// samples of libc malloc's stack spread over the run (every K-th call, K
// from the traced run's count) and count how many are, frame for frame
// (return addresses), one of the stacks the BPF unwinder captured.
// --tables: per executable file mapped: its CFI table's rows, bytes and
// build time (built again here, outside the traced run).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "unwind/cfi_table.h"
#include "shell.h"

using namespace memtrace::unwind;

namespace {


// gdb's stacks (return addresses from frame #1, real frames only) at every
// `every`-th call of libc's malloc, at most `limit` of them.
std::vector<std::vector<uint64_t>> gdb_samples(const std::vector<std::string>& cmd, uint64_t every,
                                               int limit) {
  char script[] = "/tmp/unwb-gdb-XXXXXX";
  int fd = mkstemp(script);
  std::string py =
      "set debuginfod enabled off\nset pagination off\nset confirm off\n"
      "set backtrace past-main on\nset backtrace limit 400\nset breakpoint pending on\n"
      "python\n"
      "class S(gdb.Breakpoint):\n"
      "    n = 0\n    taken = 0\n"
      "    def stop(self):\n"
      "        f = gdb.newest_frame()\n"
      "        so = gdb.solib_name(f.pc()) or ''\n"
      "        if 'libc.so' not in so: return False\n"
      "        self.n += 1\n"
      "        if self.n % " + std::to_string(every) + " or self.taken >= " + std::to_string(limit) + ": return False\n"
      "        self.taken += 1\n"
      "        out = []\n"
      "        while f is not None:\n"
      "            if f.type() == gdb.NORMAL_FRAME: out.append('%x' % f.pc())\n"
      "            f = f.older()\n"
      "        print('SAMPLE ' + ' '.join(out[1:]))\n"
      "        return False\n"
      "S('__libc_malloc')\n"
      "end\nrun\n";
  if (write(fd, py.data(), py.size()) != ssize_t(py.size())) std::fprintf(stderr, "write gdb script\n");
  close(fd);
  std::string line = "DEBUGINFOD_URLS= gdb -batch -nx -x " + std::string(script) + " --args";
  for (auto& a : cmd) line += " '" + a + "'";
  std::string out = memtrace::testing::shell_output(line + " 2>&1 </dev/null");
  unlink(script);
  std::vector<std::vector<uint64_t>> samples;
  std::istringstream in(out);
  for (std::string l; std::getline(in, l);) {
    if (l.rfind("SAMPLE ", 0) != 0) continue;
    std::istringstream ls(l.substr(7));
    std::vector<uint64_t> s;
    for (std::string w; ls >> w;) s.push_back(std::stoull(w, nullptr, 16));
    samples.push_back(std::move(s));
  }
  if (samples.empty()) std::fprintf(stderr, "gdb took no samples:\n%s\n", out.substr(0, 4000).c_str());
  return samples;
}

}  // namespace

int main(int argc, char** argv) {
  harness::Options opt;
  opt.timeout_ms = 600000;
  std::vector<std::string> cmd;
  int gdb_n = 0;
  bool tables = false;
  int i = 1;
  for (; i < argc; i++) {
    if (!std::strcmp(argv[i], "--fp")) opt.unwind = false;
    else if (!std::strcmp(argv[i], "--gdb") && i + 1 < argc) gdb_n = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--tables")) tables = true;
    else if (!std::strcmp(argv[i], "--")) { i++; break; }
    else break;
  }
  if (gdb_n > 0) opt.no_aslr = true;  // the addresses gdb sees
  for (; i < argc; i++) cmd.push_back(argv[i]);
  if (cmd.empty()) {
    std::fprintf(stderr, "usage: unwind_bench [--fp] [--gdb N] [--tables] -- CMD...\n");
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
  // Depth distribution (frames per allocation stack, weighted by
  // allocations): what chose MT_MAX_FRAMES. A stack cut at the limit counts
  // as that deep; "depth_max" says whether the limit was reached.
  {
    std::vector<std::pair<size_t, uint64_t>> d;  // (frames, allocations)
    for (auto& s : run->stacks) d.emplace_back(s.ips.size(), s.count);
    std::sort(d.begin(), d.end());
    auto quantile = [&](double q) {
      uint64_t want = uint64_t(q * double(total)), seen = 0;
      for (auto& [n, k] : d)
        if ((seen += k) > want) return n;
      return d.empty() ? size_t(0) : d.back().first;
    };
    auto over = [&](size_t lim) {
      uint64_t k = 0;
      for (auto& [n, cnt] : d) k += n > lim ? cnt : 0;
      return pct(k, total);
    };
    std::printf("{\"cmd\": \"%s\", \"frame_limit\": %d, \"depth_p50\": %zu, \"depth_p99\": %zu, "
                "\"depth_p999\": %zu, \"depth_max\": %zu, \"depth_over_64_pct\": %.3f, \"depth_over_96_pct\": %.3f, "
                "\"depth_over_128_pct\": %.3f, \"depth_over_192_pct\": %.3f, \"depth_over_256_pct\": %.3f}\n",
                label.c_str(), MT_MAX_FRAMES, quantile(0.5), quantile(0.99), quantile(0.999),
                d.empty() ? size_t(0) : d.back().first, over(64), over(96), over(128), over(192), over(256));
  }
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
  if (gdb_n > 0) {
    std::set<std::vector<uint64_t>> ours;
    for (auto& st : run->stacks) ours.insert(st.ips);
    auto samples = gdb_samples(cmd, std::max<uint64_t>(1, total / uint64_t(gdb_n)), gdb_n);
    size_t match = 0;
    std::string misses;
    harness::Symbolizer sym(run->maps);
    auto where = [&](uint64_t ip) {
      std::string f = sym.file(ip);
      char b[32];
      std::snprintf(b, sizeof b, "%#lx", (unsigned long)ip);
      return sym.name(ip) + "@" + f.substr(f.rfind('/') + 1) + ":" + b;
    };
    // gdb walks on past the outermost frame of ld.so's _start (the frame
    // that runs the constructors) into argc and argv: what is not code ends
    // its stack.
    auto code = [&](uint64_t ip) {
      for (auto& m : run->maps)
        if (ip >= m.start && ip < m.end) return m.exec();
      return false;
    };
    for (auto& g : samples) {
      size_t keep = 0;
      while (keep < g.size() && code(g[keep])) keep++;
      g.resize(keep);
      // The captured stack that agrees with gdb's longest.
      size_t best = 0;
      const std::vector<uint64_t>* bo = nullptr;
      for (auto& o : ours) {
        size_t k = 0;
        while (k < o.size() && k < g.size() && o[k] == g[k]) k++;
        if (k > best || !bo) best = k, bo = &o;
      }
      // equal frame for frame; a BPF stack cut at the depth limit is a prefix
      bool ok = bo && ((best == g.size() && best == bo->size()) ||
                       (best == bo->size() && bo->size() == size_t(MT_MAX_FRAMES)));
      match += ok;
      if (!ok && misses.size() < 8000) {
        misses += "gdb stack not among ours; they agree on " + std::to_string(best) + " frames (" +
                  (best ? where(g[best - 1]) : std::string("-")) + "), then gdb:";
        for (size_t k = best; k < g.size() && k < best + 3; k++) misses += " " + where(g[k]);
        misses += " | ours:";
        for (size_t k = best; bo && k < bo->size() && k < best + 3; k++) misses += " " + where((*bo)[k]);
        misses += "\n";
      }
    }
    std::printf("{\"cmd\": \"%s\", \"gdb_samples\": %zu, \"gdb_equal\": %zu}\n", label.c_str(), samples.size(),
                match);
    std::fprintf(stderr, "%s", misses.c_str());
  }
  if (tables) {
    std::set<std::string> seen;
    for (auto& m : run->maps) {
      if (m.perms.size() < 3 || m.perms[2] != 'x' || m.path.empty() || m.path[0] != '/') continue;
      if (!seen.insert(m.path).second) continue;
      auto t0 = std::chrono::steady_clock::now();
      auto t = build_cfi_table(m.path);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (!t) continue;
      std::printf("{\"file\": \"%s\", \"rows\": %zu, \"table_bytes\": %zu, \"fdes\": %zu, \"build_ms\": %.1f}\n",
                  m.path.c_str(), t->rows.size(), t->bytes(), t->fdes, ms);
    }
  }
  return 0;
}
