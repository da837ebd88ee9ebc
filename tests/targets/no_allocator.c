/* A process without any allocator: static, no libc. Sleeps until killed. */
#include <sys/syscall.h>
void _start(void) {
  for (;;) {
    long ts[2] = {1, 0}, ret;
    /* rax is the syscall's result too: as an input only, the compiler kept
     * the first result (0) as the next call's number, read(), and spun. */
    __asm__ volatile("syscall" : "=a"(ret) : "a"(SYS_nanosleep), "D"(ts), "S"(0) : "rcx", "r11", "memory");
    (void)ret;
  }
}
