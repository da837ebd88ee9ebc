/* Built -g -O2 -fno-asynchronous-unwind-tables -fno-unwind-tables: its own
 * functions have CFI only in .debug_frame. */
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int twice(int x) { return x * 2 + rand(); }
__attribute__((noinline)) int thrice(int x) { char buf[100]; snprintf(buf, sizeof buf, "%d", x); return atoi(buf) * 3; }
int main(int argc, char **argv) { (void)argv; return twice(argc) + thrice(argc); }
