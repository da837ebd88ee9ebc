/* The demo program scripts/demo.sh traces: a small "request handler" that
 * keeps a cache, leaks one buffer per request on an error path, maps a
 * scratch area directly, and exits. memtrace-bpf shows the heap summary and
 * the leak grouped by its call stack (handle_request -> parse_header). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

struct entry {
  char *key;
  struct entry *next;
};
static struct entry *cache;

__attribute__((noinline)) static char *parse_header(int i) {
  char *h = malloc(64 + i % 16); /* leaked when the request fails */
  snprintf(h, 64, "GET /item/%d", i);
  return h;
}

__attribute__((noinline)) static void remember(const char *key) {
  struct entry *e = calloc(1, sizeof *e);
  e->key = strdup(key);
  e->next = cache;
  cache = e;
}

__attribute__((noinline)) static void handle_request(int i) {
  char *h = parse_header(i);
  if (i % 10 == 0) return; /* the error path forgets to free h */
  char *body = malloc(4096);
  memset(body, 'x', 4096);
  if (i % 25 == 0) remember(h);
  body = realloc(body, 8192);
  free(body);
  free(h);
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 1000;
  void *scratch = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  for (int i = 0; i < n; i++) handle_request(i);
  munmap(scratch, 1 << 20);
  printf("demo: handled %d requests\n", n);
  return 0;
}
