/* Allocations for the unwinder tests, built -O2 -fomit-frame-pointer (and
 * linked with libunwind_nofp.so, also without frame pointers). Each mode
 * makes exactly one allocation of UNW_MARK bytes through a known chain; the
 * test compares the BPF stack of that malloc with gdb's `bt`.
 *
 *   unwind_target MODE      MODE: chain | qsort | shlib | thread | recurse
 */
#include <alloca.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define UNW_MARK 123457
#define NOINL __attribute__((noinline, noclone))

extern void *lib_entry(size_t n); /* libunwind_nofp.so */

volatile int sink;
void *volatile keep;

/* Each function does work after its call: no tail calls, every frame stays. */
NOINL void *c6(size_t n) { void *p = malloc(n); sink += 6; return p; }
NOINL void *c5(size_t n) { void *p = c6(n + sink * 0); sink += 5; return p; }
NOINL void *c4(size_t n) { void *p = c5(n); sink += 4; return p; }
/* c3 realigns its stack and has an alloca: gcc keeps the incoming stack
 * pointer in a DRAP register and describes the CFA as *(rbp-8) (the
 * unwinder's MT_CFA_RBP_DEREF rows). */
NOINL void *c3(size_t n)
{
	char a[64] __attribute__((aligned(64)));
	char *v = __builtin_alloca(16 + (sink & 1));
	memset(a, sink, sizeof(a));
	memset(v, sink, 16);
	void *p = c4(n);
	sink += a[1] + v[2] + 3;
	return p;
}
NOINL void *c2(size_t n) { void *p = c3(n); sink += 2; return p; }
NOINL void *c1(size_t n) { void *p = c2(n); sink += 1; return p; }

static int calls;
NOINL int cmp_ints(const void *a, const void *b)
{
	if (calls++ == 3)
		keep = malloc(UNW_MARK);
	return *(const int *)a - *(const int *)b;
}

NOINL void *recurse(int depth, size_t n)
{
	void *p = depth == 0 ? malloc(n) : recurse(depth - 1, n);
	sink += depth;
	return p;
}

NOINL void *thread_work(size_t n) { void *p = malloc(n); sink++; return p; }
NOINL void *thread_main(void *arg) { keep = thread_work(UNW_MARK); sink++; return NULL; }

NOINL void run(const char *mode)
{
	if (!strcmp(mode, "chain")) {
		keep = c1(UNW_MARK);
	} else if (!strcmp(mode, "qsort")) {
		int v[64];
		for (int i = 0; i < 64; i++)
			v[i] = (i * 37) % 64;
		qsort(v, 64, sizeof(int), cmp_ints);
	} else if (!strcmp(mode, "shlib")) {
		keep = lib_entry(UNW_MARK);
	} else if (!strcmp(mode, "thread")) {
		pthread_t t;
		pthread_create(&t, NULL, thread_main, NULL);
		pthread_join(t, NULL);
	} else if (!strcmp(mode, "recurse")) {
		keep = recurse(200, UNW_MARK);
	}
	sink++;
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return 2;
	run(argv[1]);
	return 0;
}
