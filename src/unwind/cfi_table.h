// CFI tables: an ELF file's .eh_frame (and .debug_frame) turned into the
// compact pc-sorted rows the BPF unwinder searches (struct mt_unwind_row in
// bpf/memtrace.h). Own DWARF CFA interpreter on top of libelf: it keeps only
// what an x86-64 unwinder needs (CFA rule, rbp rule, return address at CFA-8)
// and recognises the two common expressions (.plt entries, gcc's stack
// realignment) instead of giving up on them. aarch64 files (issue 20): CFA on
// sp/x29, x29's and x30's (the return address's) save slots, the x30 of
// leaf functions and .plt stubs (bpf/memtrace.h, mt_ra_rule_arm64).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/result.h"
#include "elf/image.h"
extern "C" {
#include "memtrace.h"
}

namespace memtrace::unwind {

// A row with full-width offsets (bytes), as the DWARF says it.
struct RowInfo {
  uint8_t cfa = MT_CFA_NONE;  // enum mt_cfa_type
  int64_t cfa_off = 0;
  uint8_t rbp = MT_RBP_SAME;  // enum mt_rbp_rule (aarch64: of x29)
  int64_t rbp_off = 0;
  // aarch64 only: where x30 is, MT_RA_REG or MT_RA_AT_CFA with its slot
  // from the CFA (MT_RA_PAIR is how encode_row_arm64 packs ra_off ==
  // rbp_off + 8; decode_row_arm64 gives it back as MT_RA_AT_CFA).
  uint8_t ra = MT_RA_REG;
  int64_t ra_off = 0;
};
// Packing into the 8-byte BPF row (offsets that do not fit: unsupported/unknown).
mt_unwind_row encode_row(const RowInfo& r);
RowInfo decode_row(const mt_unwind_row& r);
// The same for an aarch64 file's rows (x30 not saved next to x29: x29 is
// given up, MT_RBP_UNKNOWN; x30 anywhere else: unsupported).
mt_unwind_row encode_row_arm64(const RowInfo& r);
RowInfo decode_row_arm64(const mt_unwind_row& r);

struct CfiTable {
  uint64_t base = 0;                  // row pc = ELF vaddr - base
  std::vector<mt_unwind_row> rows;    // sorted by pc, consecutive duplicates merged
  std::string build_id;               // hex, "" if none
  std::string path;                   // the file it was built from (messages)
  std::vector<elf::Segment> segments;  // PT_LOAD (a mapping's file offset -> load bias)
  uint16_t machine = 0;               // EM_X86_64 or EM_AARCH64: how rows read (decode_row*)
  // Statistics of the build.
  size_t fdes = 0;                    // FDEs used
  size_t fdes_debug_frame = 0;        // of which from .debug_frame
  size_t fdes_skipped = 0;            // overlapping / empty / unreadable
  size_t rows_unsupported = 0;
  // [begin, end) of every FDE used, sorted: the functions the CFI knows,
  // named or not (a stripped file's .cold parts: src/python).
  std::vector<std::pair<uint64_t, uint64_t>> fde_ranges;

  size_t bytes() const { return rows.size() * sizeof(mt_unwind_row); }
  // Row covering ELF vaddr (nullptr: before the first row / beyond 4 GiB).
  const mt_unwind_row* lookup(uint64_t vaddr) const;
};

// Parse the CFI of one ELF file (x86-64 or aarch64). A file without any CFI gives an
// empty table (the unwinder then falls back to frame pointers inside it).
Result<CfiTable> build_cfi_table(const elf::Image& img);
Result<CfiTable> build_cfi_table(const std::string& path);
Result<CfiTable> build_cfi_table_fd(int fd, const std::string& what);  // fd stays the caller's

const char* cfa_type_name(uint8_t t);

}  // namespace memtrace::unwind
