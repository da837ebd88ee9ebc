/* A target for --inject's entry trampolines (issue 21): calls the
 * allocator through pointers dlsym returns (libc's functions themselves,
 * no GOT slot on the way), which only a hook at the functions' entries sees.
 *
 *   dlsym_target N
 *
 * Prints "ready PID", waits for a line on stdin (the tool attaches
 * meanwhile), then N times: malloc(333) and calloc(1, 444) through dlsym'd
 * pointers; frees every calloc'd block through a dlsym'd free; leaks the
 * malloc'd ones. Prints "done" and exits 0 at EOF of stdin. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void* volatile sink;

static int line_on_stdin(void) {
  char c = 0;
  while (read(0, &c, 1) == 1)
    if (c == '\n') return 1;
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  int n = atoi(argv[1]);
  void* (*m)(size_t) = (void* (*)(size_t))dlsym(RTLD_NEXT, "malloc");
  void* (*c)(size_t, size_t) = (void* (*)(size_t, size_t))dlsym(RTLD_NEXT, "calloc");
  void (*f)(void*) = (void (*)(void*))dlsym(RTLD_NEXT, "free");
  if (!m || !c || !f) return 3;
  printf("ready %d\n", (int)getpid());
  fflush(stdout);
  if (!line_on_stdin()) return 4;
  for (int i = 0; i < n; i++) {
    sink = m(333);
    void* p = c(1, 444);
    f(p);
  }
  printf("done\n");
  fflush(stdout);
  while (line_on_stdin()) {
  }
  return 0;
}
