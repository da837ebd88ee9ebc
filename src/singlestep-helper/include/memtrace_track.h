/* memtrace_track: track accesses to a region of the calling process's own
 * memory, byte-granular (the in-process API of seed 000, kept source
 * compatible). Implemented by starting memtrace-singlestep on the calling
 * process (prctl(PR_SET_PTRACER)), not by signal handlers in the process: it
 * is exact with several threads and leaves SIGSEGV/SIGTRAP to the program.
 *
 *   MemTracker* t = StartTrackMemory(buf, 4096, 1000, STDERR_FILENO);
 *   ... accesses ...
 *   EndTrackMemory(t);               // t->num_access, t->addrs[i] now valid
 *   FreeMemTracker(t);
 *
 * The helper binary is found through $MEMTRACE_SINGLESTEP, then next to the
 * build or install location, then on $PATH. Needs ptrace permission (root,
 * or Yama ptrace_scope <= 1).
 */
#ifndef MEMTRACE_TRACK_H
#define MEMTRACE_TRACK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

enum MemTrackKind { MEMTRACK_READ = 1, MEMTRACK_WRITE = 2, MEMTRACK_READ_WRITE = 3 };

typedef struct MemTrackAccess {
  uint64_t time_ns; /* CLOCK_MONOTONIC */
  pid_t tid;
  uint64_t ip;
  uint64_t addr;
  uint32_t size; /* bytes */
  int kind;      /* enum MemTrackKind */
} MemTrackAccess;

typedef struct MemTracker {
  void* addr;
  size_t len;
  size_t max_num; /* 0: unlimited */
  int fd;         /* a text log of the accesses is written here by EndTrackMemory; -1: none */
  /* Valid after EndTrackMemory: */
  size_t num_access;
  void** addrs;             /* num_access addresses, in access order */
  MemTrackAccess* accesses; /* num_access records */
  /* Private. */
  pid_t helper_pid;
  char report_path[64];
} MemTracker;

/* Start tracking [addr, addr+len) (any address and length). Returns NULL with
 * errno set if the helper could not start or arm (reason on stderr). Returns
 * once every access from then on is captured. */
MemTracker* StartTrackMemory(void* addr, size_t len, size_t max_num, int fd);
/* Stop tracking (protections restored, helper detached) and fill num_access,
 * addrs and accesses. Returns 0, or -1 if the helper failed. */
int EndTrackMemory(MemTracker* tracker);
void FreeMemTracker(MemTracker* tracker);

#ifdef __cplusplus
}
#endif

#endif /* MEMTRACE_TRACK_H */
