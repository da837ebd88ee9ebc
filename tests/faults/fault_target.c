/* Page-fault test target (tests/faults). Prints the exact expectations:
 *
 *   buffer first=0x.. end=0x.. pages=N      one write per page in [first, end)
 *   untouched addr=0x.. size=N              a block never touched
 *   file path=P addr=0x.. len=N             a file mapping read page by page
 *
 * The 4 MiB buffer comes from alloc_buffer() (malloc, so glibc mmaps it; its
 * first page already holds the chunk header malloc wrote, so the pages
 * written start at the first page boundary inside the block). Transparent
 * huge pages are turned off for it (MADV_NOHUGEPAGE): one fault per 4 KiB
 * page. That madvise comes after malloc wrote the chunk header: with THP
 * "always" (Debian's kernels) and glibc's mapping 2 MiB-aligned, that first
 * write already made a huge page of the buffer's first 2 MiB (split, still
 * present, by the madvise): 511 pages never faulted, 513 of 1024 counted.
 * So THP is off for the whole process (PR_SET_THP_DISABLE) before any
 * allocation. write_pages() writes one byte per page, then read_pages() reads them
 * (no fault: already present and writable).
 *
 * --wait: wait for a line on stdin before the writes (-p tests attach then).
 * --linger-ms MS: stay alive (mappings intact) this long before unmapping the
 * file and exiting, so that the tracer reads /proc/PID/maps while they exist.
 * --sweeps N --gap-ms MS: afterwards, wait for another line, then read the
 * first --sweep-pages pages N times, sleeping MS between sweeps (--rearm). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define BUF_SIZE (4UL << 20)

static volatile unsigned long sink;

__attribute__((noinline)) char *alloc_buffer(void) { return malloc(BUF_SIZE); }
__attribute__((noinline)) char *alloc_untouched(void) { return malloc(1UL << 20); }

__attribute__((noinline)) void write_pages(char *first, char *end)
{
	for (char *p = first; p < end; p += PAGE)
		*(volatile char *)p = 1;
}

__attribute__((noinline)) void read_pages(char *first, char *end)
{
	unsigned long s = 0;
	for (char *p = first; p < end; p += PAGE)
		s += *(volatile char *)p;
	sink = s;
}

__attribute__((noinline)) void read_file(const char *m, size_t len)
{
	unsigned long s = 0;
	for (size_t o = 0; o < len; o += PAGE)
		s += *(volatile const char *)(m + o);
	sink += s;
}

__attribute__((noinline)) void sweep_pages(char *first, unsigned long n)
{
	unsigned long s = 0;
	for (unsigned long i = 0; i < n; i++)
		s += *(volatile char *)(first + i * PAGE);
	sink += s;
}

static void wait_line(void)
{
	char b[64];
	if (!fgets(b, sizeof b, stdin))
		exit(3);
}

int main(int argc, char **argv)
{
	int wait = 0, sweeps = 0, gap_ms = 100, linger_ms = 0;
	unsigned long sweep_pages_n = 64, file_pages = 64;
	const char *file = NULL;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--wait")) wait = 1;
		else if (!strcmp(argv[i], "--sweeps") && i + 1 < argc) sweeps = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--gap-ms") && i + 1 < argc) gap_ms = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--sweep-pages") && i + 1 < argc) sweep_pages_n = strtoul(argv[++i], 0, 0);
		else if (!strcmp(argv[i], "--file") && i + 1 < argc) file = argv[++i];
		else if (!strcmp(argv[i], "--linger-ms") && i + 1 < argc) linger_ms = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--file-pages") && i + 1 < argc) file_pages = strtoul(argv[++i], 0, 0);
	}
	if (prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0)
		perror("PR_SET_THP_DISABLE");
	setvbuf(stdout, NULL, _IOLBF, 0);
	char *buf = alloc_buffer();
	char *untouched = alloc_untouched();
	if (!buf || !untouched)
		return 1;
	char *first = (char *)(((uintptr_t)buf + PAGE - 1) & ~(PAGE - 1));
	char *end = buf + BUF_SIZE;
	char *aligned_end = (char *)((uintptr_t)end & ~(PAGE - 1));
	if (madvise(first, aligned_end - first, MADV_NOHUGEPAGE) != 0)
		perror("madvise");
	unsigned long pages = (end - first + PAGE - 1) / PAGE;
	printf("buffer first=%p end=%p pages=%lu block=%p\n", (void *)first, (void *)end, pages, (void *)buf);
	printf("untouched addr=%p size=%lu\n", (void *)untouched, 1UL << 20);
	printf("ready\n");
	if (wait)
		wait_line();
	write_pages(first, end);
	read_pages(first, end);

	if (file) {
		int fd = open(file, O_RDWR | O_CREAT | O_TRUNC, 0600);
		if (fd < 0)
			return 1;
		char page[PAGE];
		memset(page, 'x', sizeof page);
		for (unsigned long i = 0; i < file_pages; i++)
			if (write(fd, page, PAGE) != (ssize_t)PAGE)
				return 1;
		size_t len = file_pages * PAGE;
		char *m = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
		if (m == MAP_FAILED)
			return 1;
		printf("file path=%s addr=%p len=%zu\n", file, (void *)m, len);
		read_file(m, len);
		printf("written\n");
		struct timespec lt = {linger_ms / 1000, (linger_ms % 1000) * 1000000L};
		nanosleep(&lt, NULL);
		munmap(m, len);
		close(fd);
	} else {
		printf("written\n");
	}
	if (sweeps) {
		wait_line();
		struct timespec ts = {gap_ms / 1000, (gap_ms % 1000) * 1000000L};
		for (int s = 0; s < sweeps; s++) {
			sweep_pages(first, sweep_pages_n);
			nanosleep(&ts, NULL);
		}
		printf("swept %d\n", sweeps);
	}
	printf("done\n");
	return 0;
}
