/* fork_exec: a fork whose child allocates once and then execs (what make
 * and sh do for every command). Each of the three images keeps one block
 * of its own size, from a function of its own:
 *   parent          parent_leak: 1111 bytes, then forks and waits
 *   child (forked)  child_leak: 2222 bytes, then execs fork_exec --exec
 *   child (exec'd)  exec_leak: 3333 bytes
 * Prints "fork_exec child <pid>" (the parent, after the child ended). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void *volatile sink;

__attribute__((noinline)) static void parent_leak(void) { sink = malloc(1111); }
__attribute__((noinline)) static void child_leak(void) { sink = malloc(2222); }
__attribute__((noinline)) static void exec_leak(void) { sink = malloc(3333); }

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--exec") == 0) {
    exec_leak();
    return 0;
  }
  parent_leak();
  pid_t pid = fork();
  if (pid < 0) return 1;
  if (pid == 0) {
    child_leak();
    execl(argv[0], argv[0], "--exec", (char *)NULL); /* argv[0]: an absolute path */
    _exit(127);
  }
  int st;
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return 2;
  printf("fork_exec child %d\n", (int)pid);
  return 0;
}
