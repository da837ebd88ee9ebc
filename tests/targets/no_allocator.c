/* A process without any allocator: static, no libc. Sleeps until killed. */
#include <sys/syscall.h>
void _start(void) {
  for (;;) {
    long ts[2] = {1, 0}, ret;
    /* rax is the syscall's result too: as an input only, the compiler kept
     * the first result (0) as the next call's number, read(), and spun. */
#if defined(__aarch64__)
    register long x8 __asm__("x8") = SYS_nanosleep;
    register long x0 __asm__("x0") = (long)ts;
    register long x1 __asm__("x1") = 0;
    __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1) : "memory");
    ret = x0;
#else
    __asm__ volatile("syscall" : "=a"(ret) : "a"(SYS_nanosleep), "D"(ts), "S"(0) : "rcx", "r11", "memory");
#endif
    (void)ret;
  }
}
