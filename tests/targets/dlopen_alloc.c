/* A glibc program that dlopen's a second allocator (argv[1], e.g.
 * libmimalloc.so.2) after start and leaks N blocks from it, called by the
 * library's own symbols: leak_from_second (N blocks of 777 bytes). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static void *volatile sink;

__attribute__((noinline)) void leak_from_second(void *(*m)(size_t), int n) {
  for (int i = 0; i < n; i++) sink = m(777);
}

int main(int argc, char **argv) {
  if (argc < 3) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 3;
  }
  void *(*m)(size_t) = (void *(*)(size_t))dlsym(h, "malloc");
  if (!m) return 4;
  leak_from_second(m, atoi(argv[2]));
  return 0;
}
