/* Loaded by cfi_target after the agent's attach (dlopen): code the loader's
 * rows do not cover, so a walk through it is libunwind's (stack_slow). */
#include <stdlib.h>

void* volatile cfi_lib_sink;

__attribute__((noinline)) void cfi_lib_alloc(size_t n) { cfi_lib_sink = malloc(n); }
