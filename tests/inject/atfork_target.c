/* atfork_target N: N forks whose children _exit(0) at once; the parent
 * waits for each and exits 0. Linked with atfork_lib.so, whose atfork child
 * handler makes 3 allocations of 100 bytes in every child. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

extern void* volatile atfork_lib_sink; /* (a reference: the library stays a DT_NEEDED under --as-needed) */

int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 10;
  for (int i = 0; i < n; i++) {
    pid_t p = fork();
    if (p < 0) return 2;
    if (p == 0) _exit(0);
    int st = 0;
    if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return 3;
  }
  if (atfork_lib_sink) return 4; /* set in the children only */
  printf("forks %d\n", n);
  return 0;
}
