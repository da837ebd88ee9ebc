/* A library that, like some real ones, registers a fork child handler that
 * allocates: from its constructor, so before memtrace-bpf --inject's agent
 * (which a launched program gets at its entry point, after the libraries'
 * constructors). Child handlers run in the order of registration: this one
 * runs in the child before the agent's own, with the parent's hooks still
 * in place. Each child: 3 blocks of 100 bytes, never freed (the child
 * _exits). */
#include <pthread.h>
#include <stdlib.h>

void* volatile atfork_lib_sink;

__attribute__((noinline)) static void atfork_child_handler(void) {
  for (int i = 0; i < 3; i++) atfork_lib_sink = malloc(100);
}

__attribute__((constructor)) static void atfork_lib_init(void) { pthread_atfork(NULL, NULL, atfork_child_handler); }
