// Calls one of uprobe_classes.S's functions N times and prints the time per
// call: uprobe_classes NAME N. Static, run in the arm64 guest
// (tests/probes/arm64/uprobe_cost.py).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FN(n) void f_##n(void*);
FN(cbz) FN(adrp) FN(stp) FN(mov) FN(nop) FN(bti) FN(paciasp) FN(autiasp) FN(ldrlit) FN(ldxr)
static const struct { const char* name; void (*f)(void*); } fns[] = {
#define E(n) {#n, f_##n},
    E(cbz) E(adrp) E(stp) E(mov) E(nop) E(bti) E(paciasp) E(autiasp) E(ldrlit) E(ldxr)};

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  long n = atol(argv[2]);
  static unsigned long word;
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    if (strcmp(fns[i].name, argv[1])) continue;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long k = 0; k < n; k++) fns[i].f(&word);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("%s %ld calls %.0f ns/call\n", argv[1], n, ns / n);
    return 0;
  }
  return 2;
}
