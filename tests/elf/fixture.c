// A small shared object for the ELF reader's tests: a static function only
// .symtab (or MiniDebugInfo) names, exported functions and data, a TLS
// variable, and a call to an imported allocator function.
#include <stdlib.h>

int elf_fixture_counter = 3;
__thread int elf_fixture_tls;
void* elf_fixture_kept;

__attribute__((noinline)) static int elf_fixture_static(int x) { return x * 7 + elf_fixture_counter; }

int elf_fixture_exported(int x) {
  free(elf_fixture_kept);
  elf_fixture_kept = aligned_alloc(64, 64);
  elf_fixture_tls += x;
  return elf_fixture_static(x) + elf_fixture_tls;
}
