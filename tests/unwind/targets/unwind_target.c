/* Allocations for the unwinder tests, built -O2 -fomit-frame-pointer (and
 * linked with libunwind_nofp.so, also without frame pointers). Each mode
 * makes exactly one allocation of UNW_MARK bytes through a known chain; the
 * test compares the BPF stack of that malloc with gdb's `bt`.
 *
 *   unwind_target MODE      MODE: chain | qsort | shlib | thread | recurse | memo | mmap
 *   unwind_target recurse [DEPTH [TIMES]]   recursion DEPTH deep (default 200),
 *                           TIMES allocations from there (default 1; the others freed)
 *
 * memo makes MEMO_CALLS allocations of UNW_MARK bytes through three paths in
 * a pseudo-random order (the test repeats the sequence to know the counts).
 */
#include <alloca.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
/* mmap: an anonymous mapping of UNW_MAP_PAGES pages through two frames
 * without frame pointers (the mmap family's stacks) */
#define UNW_MAP_PAGES 29
NOINL void *mm2(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	sink += 3;
	return p == MAP_FAILED ? NULL : p;
}
NOINL void *mm1(size_t n) { void *p = mm2(n + sink * 0); sink += 1; return p; }
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

/* Two paths that reach malloc through m_leaf at the same rsp and with the
 * same first frame (the return address into m_leaf), and lay out the stack
 * above differently: m_a has a 512-byte frame, m_b a small one, and w_b's
 * alloca makes up the difference (calibrated at run time). The BPF walk
 * memo, keyed by rsp and first frame, must tell them apart by the stack
 * words further up, not replay one path's frames for the other. */
#define MEMO_CALLS 3000
static char *volatile leaf_sp[2];
NOINL void *m_leaf(size_t n, int which)
{
	volatile char x = 0;
	leaf_sp[which] = (char *)&x;
	void *p = malloc(n);
	sink += x + 7;
	return p;
}
NOINL void *m_a(size_t n)
{
	volatile char big[512];
	big[sink & 511] = 1;
	void *p = m_leaf(n, 0);
	sink += 1 + big[0];
	return p;
}
NOINL void *m_b(size_t n) { void *p = m_leaf(n, 1); sink += 2; return p; }
/* w_a and w_b: the same code (so the same frame), each calling its own path */
#define MEMO_WRAPPER(name, callee)                              \
	NOINL void *name(size_t n, size_t pad)                  \
	{                                                       \
		char *v = __builtin_alloca(pad + 1);            \
		v[0] = 0;                                       \
		__asm__ volatile("" : : "r"(v) : "memory");     \
		void *p = callee(n);                            \
		sink += v[0];                                   \
		return p;                                       \
	}
MEMO_WRAPPER(w_a, m_a)
MEMO_WRAPPER(w_b, m_b)

NOINL void *thread_work(size_t n) { void *p = malloc(n); sink++; return p; }
NOINL void *thread_main(void *arg) { keep = thread_work(UNW_MARK); sink++; return NULL; }

static int rec_depth = 200, rec_times = 1;

NOINL void run(const char *mode)
{
	if (!strcmp(mode, "chain")) {
		keep = c1(UNW_MARK);
	} else if (!strcmp(mode, "qsort")) {
		int v[64];
		for (int i = 0; i < 64; i++)
			v[i] = (i * 37) % 64;
		qsort(v, 64, sizeof(int), cmp_ints);
	} else if (!strcmp(mode, "mmap")) {
		keep = mm1(UNW_MAP_PAGES * 4096);
		for (int i = 0; keep && i < UNW_MAP_PAGES; i++) /* one write fault per page (--faults) */
			((volatile char *)keep)[i * 4096] = 1;
	} else if (!strcmp(mode, "shlib")) {
		keep = lib_entry(UNW_MARK);
	} else if (!strcmp(mode, "thread")) {
		pthread_t t;
		pthread_create(&t, NULL, thread_main, NULL);
		pthread_join(t, NULL);
	} else if (!strcmp(mode, "recurse")) {
		for (int i = 0; i < rec_times; i++) {
			free(keep);
			keep = recurse(rec_depth, UNW_MARK);
		}
	} else if (!strcmp(mode, "memo")) {
		/* calibrate w_b's alloca (1-byte mallocs: not marked) */
		size_t pad = 0;
		for (int k = 0; k < 8; k++) {
			free(w_a(1, 0));
			free(w_b(1, pad));
			if (leaf_sp[0] == leaf_sp[1] || leaf_sp[1] < leaf_sp[0])
				break;
			pad += leaf_sp[1] - leaf_sp[0];
		}
		if (leaf_sp[0] != leaf_sp[1]) {
			fprintf(stderr, "m_a and m_b do not reach malloc at the same rsp\n");
			exit(3);
		}
		/* the third path is the chain above: its rsp at malloc changes
		 * with c3's alloca (sink's parity), its frames do not */
		unsigned s = 12345, na = 0, nb = 0, nc = 0;
		for (int i = 0; i < MEMO_CALLS; i++) {
			void *p;
			s = s * 1103515245u + 12345u;
			switch ((s >> 16) % 3) {
			case 0: p = w_a(UNW_MARK, 0); na++; break;
			case 1: p = w_b(UNW_MARK, pad); nb++; break;
			default: p = c1(UNW_MARK); nc++; break;
			}
			free(p);
		}
		printf("memo %u %u %u (pad %zu)\n", na, nb, nc, pad);
		if (leaf_sp[0] != leaf_sp[1]) {
			fprintf(stderr, "m_a and m_b reached malloc at different rsp\n");
			exit(3);
		}
	}
	sink++;
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return 2;
	if (argc > 2)
		rec_depth = atoi(argv[2]);
	if (argc > 3)
		rec_times = atoi(argv[3]);
	run(argv[1]);
	return 0;
}
