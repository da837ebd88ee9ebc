// memtrace-unwind-table [--stats] FILE...: the CFI rows the BPF unwinder
// would use for each file (for debugging and for comparing with
// `readelf --debug-dump=frames-interp`).
#include <elf.h>

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
      bool arm64 = t->machine == EM_AARCH64;
      auto r = arm64 ? memtrace::unwind::decode_row_arm64(row) : memtrace::unwind::decode_row(row);
      const char* fp = arm64 ? "x29" : "rbp";
      std::printf("  %016lx %-11s %6ld", (unsigned long)(t->base + row.pc),
                  arm64 && r.cfa == MT_CFA_RSP ? "sp" : arm64 && r.cfa == MT_CFA_RBP ? "x29"
                                                                                   : memtrace::unwind::cfa_type_name(r.cfa),
                  (long)r.cfa_off);
      switch (r.rbp) {
        case MT_RBP_SAME: std::printf("  %s=same", fp); break;
        case MT_RBP_AT_CFA: std::printf("  %s=[cfa%+ld]", fp, (long)r.rbp_off); break;
        case MT_RBP_AT_RBP: std::printf("  %s=[rbp%+ld]", fp, (long)r.rbp_off); break;
        default: std::printf("  %s=?", fp); break;
      }
      if (arm64 && r.ra == MT_RA_AT_CFA) std::printf("  x30=[cfa%+ld]", (long)r.ra_off);
      else if (arm64) std::printf("  x30=x30");
      std::printf("\n");
    }
  }
  return rc;
}
