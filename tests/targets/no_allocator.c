/* A process without any allocator: static, no libc. Sleeps until killed. */
#include <sys/syscall.h>
void _start(void) {
  for (;;) {
    long ts[2] = {1, 0};
    __asm__ volatile("syscall" : : "a"(SYS_nanosleep), "D"(ts), "S"(0) : "rcx", "r11", "memory");
  }
}
