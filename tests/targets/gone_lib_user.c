/* gone_lib_user: leaks one block of 4321 bytes through two libraries that
 * no other process maps (gone_lib_outer < gone_lib_inner < malloc), found
 * through its RUNPATH ($ORIGIN). Prints "gone_lib_user <pid>". */
#include <stdio.h>
#include <unistd.h>

void *gone_lib_outer(size_t n);

int main(void) {
  gone_lib_outer(4321);
  printf("gone_lib_user %d\n", (int)getpid());
  return 0;
}
