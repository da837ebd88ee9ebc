/* A shared library built -O2 -fomit-frame-pointer: its frames are only
 * recoverable from .eh_frame. */
#include <stdlib.h>

#define NOINL __attribute__((noinline, noclone))
volatile int lib_sink;

NOINL void *lib_inner(size_t n) { void *p = malloc(n); lib_sink++; return p; }
NOINL void *lib_middle(size_t n) { void *p = lib_inner(n); lib_sink++; return p; }
void *lib_entry(size_t n) { void *p = lib_middle(n); lib_sink++; return p; }
