/* fork_storm N: forks N children one after another; each allocates and
 * frees a little and exits. For the tests that kill the tool at random
 * moments while it follows forks (tests/loader/guardian_test.cpp). */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void *volatile sink;

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 100;
  for (int i = 0; i < n; i++) {
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      sink = malloc(100);
      free(sink);
      _exit(0);
    }
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return 2;
  }
  printf("forks %d\n", n);
  return 0;
}
