// Leaks 16 blocks from functions of its own. The tests strip it (no .symtab,
// no DWARF, no .gnu_debuglink: only its build-id leads to the debug file), so
// its frames get names and lines only from a debug file found by build-id:
// --symbols DIR or a debuginfod server.
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) static char* make_name(int i) {
  char* p = malloc(64);  // MARK-LEAK
  snprintf(p, 64, "name-%d", i);
  return p;
}

__attribute__((noinline)) static void keep_names(char** out, int n) {
  for (int i = 0; i < n; i++) out[i] = make_name(i);  // MARK-CALL
}

int main(void) {
  static char* names[16];
  keep_names(names, 16);
  printf("ok %s\n", names[3]);
  return 0;
}
