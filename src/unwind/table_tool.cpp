// memtrace-unwind-table [--stats] FILE...: the CFI rows the BPF unwinder
// would use for each file (for debugging and for comparing with
// `readelf --debug-dump=frames-interp`).
#include <cstdio>
#include <cstring>

#include "unwind/cfi_table.h"

int main(int argc, char** argv) {
  bool stats_only = false;
  int rc = 0;
  for (int i = 1; i < argc; i++) {
    if (std::strcmp(argv[i], "--stats") == 0) {
      stats_only = true;
      continue;
    }
    auto t = memtrace::unwind::build_cfi_table(argv[i]);
    if (!t) {
      std::fprintf(stderr, "%s\n", t.error().message.c_str());
      rc = 1;
      continue;
    }
    std::printf("%s: build-id %s, base 0x%lx, %zu FDEs (%zu .debug_frame, %zu skipped), %zu rows "
                "(%zu unsupported), %zu bytes\n",
                argv[i], t->build_id.c_str(), (unsigned long)t->base, t->fdes, t->fdes_debug_frame,
                t->fdes_skipped, t->rows.size(), t->rows_unsupported, t->bytes());
    if (stats_only) continue;
    for (auto& row : t->rows) {
      auto r = memtrace::unwind::decode_row(row);
      std::printf("  %016lx %-11s %6ld", (unsigned long)(t->base + row.pc),
                  memtrace::unwind::cfa_type_name(r.cfa), (long)r.cfa_off);
      switch (r.rbp) {
        case MT_RBP_SAME: std::printf("  rbp=same\n"); break;
        case MT_RBP_AT_CFA: std::printf("  rbp=[cfa%+ld]\n", (long)r.rbp_off); break;
        case MT_RBP_AT_RBP: std::printf("  rbp=[rbp%+ld]\n", (long)r.rbp_off); break;
        default: std::printf("  rbp=?\n"); break;
      }
    }
  }
  return rc;
}
