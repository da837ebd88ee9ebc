/* The contract between the injected agent (src/inject/agent.cpp, inside the
 * traced process) and the loader (src/inject/session.cpp): a shared-memory
 * ring of records. Plain C, fixed-width types, no pointers (STYLE.md #1);
 * both sides include this file.
 *
 * The loader creates /dev/shm/memtrace-inject.PID (MT_INJ_PATH_FMT, PID the
 * target's tgid), owned by the target's uid, mode 0600, before it makes the
 * target dlopen the agent; the agent's constructor maps it (MAP_SHARED) and
 * the loader unlinks the name once the agent has said it is there
 * (agent_state). The records are the BPF path's own, bpf/memtrace.h: an
 * mt_event per allocator call, an mt_stack per distinct stack; the loader
 * feeds them to the same heap model (heap::HeapModel::apply).
 *
 * The ring: many producers (the target's threads), one consumer (the
 * loader), lock-free. A producer reserves bytes with a CAS on head; a
 * record never crosses the end of the data area (a pad record fills the
 * rest). Every record starts with one 8-byte word written last, with
 * release order: len << 48 | (MT_INJ_PAD if a pad) | (pos & MT_INJ_POS_MASK),
 * pos being the record's absolute stream position. The consumer reads the
 * word at tail with acquire order: the record is complete when its pos
 * bits are tail's and its length is not 0 (stale bytes of the last lap carry
 * an older position; the untouched ring's zeros, position 0), so
 * nothing is ever zeroed. A full ring makes the writer wait while the
 * loader's heartbeat is fresh (full_waits); a record is dropped (drops) only
 * when the loader is gone or detached.
 *
 * Compact records (version 2): the agent writes the common calls as
 * struct mt_inj_rec, not as a 64-byte mt_event: a free is 24 bytes after
 * the record word (32 in all, against 72), an allocation 40, a realloc's
 * new block 48; the body's length says which fields are there. The first
 * u32 has MT_INJ_COMPACT set (an mt_event's or mt_stack's is an enum
 * mt_kind, small), and the loader expands each into the mt_event the heap
 * model takes. ts is the TSC when ts_mode is MT_INJ_TS_TSC (the loader
 * converts it to CLOCK_MONOTONIC ns, calibrated at every drain), else ns. */
#ifndef MEMTRACE_INJECT_RING_H
#define MEMTRACE_INJECT_RING_H

#include <stdint.h>

#include "memtrace.h" /* struct mt_py_proc, the records */

#define MT_INJ_MAGIC 0x314a4e4945544d4dull /* "MMTEINJ1" */
#define MT_INJ_VERSION 6
#define MT_INJ_PATH_FMT "/dev/shm/memtrace-inject.%d"
#define MT_INJ_HDR_BYTES 8192 /* the data area starts two pages in */
#define MT_INJ_POS_MASK ((1ull << 47) - 1)
#define MT_INJ_PAD (1ull << 47)
#define MT_INJ_REC_HDR 8 /* the word in front of every record */
#define MT_INJ_ENTRY_MAX 48
#define MT_INJ_TRAMP_BYTES (256 * 1024) /* islands spread over 256 KiB: a jmp's rel32 free of 0xcc bytes (uprobes) */
#define MT_INJ_TRAMP_SLOT 64            /* one stub per entry at tramp + i * MT_INJ_TRAMP_SLOT */

/* state: written by the loader. */
enum mt_inj_state {
	MT_INJ_WAITING = 0,  /* created, the agent may map it */
	MT_INJ_ATTACHED = 1, /* records wanted */
	MT_INJ_DETACHED = 2, /* the loader is done: hooks call straight through */
};

/* agent_state: written by the agent. */
enum mt_inj_agent_state {
	MT_INJ_AGENT_NONE = 0,
	MT_INJ_AGENT_HOOKED = 1, /* ring mapped, GOT slots rewritten */
	MT_INJ_AGENT_FAILED = 2, /* ring mapped, nothing hooked (agent_error says why) */
};

/* hook_flags: written by the loader before the agent loads. */
#define MT_INJ_NO_GOT 1u
#define MT_INJ_CFI_VERIFY 2u /* MT_INJ_STACK_CFI: every walk the rows finish is compared with libunwind's (stack_verified, stack_mismatch) */

/* The program's allocator, as the loader found it (src/probes/allocators.cpp,
 * the BPF path's detection), when it is not glibc's: jemalloc, tcmalloc,
 * mimalloc, preloaded or linked in, with their prefixed names (je_malloc)
 * and their other entries (C++ operator new/delete, sized and aligned
 * deletes, mallocx/rallocx/sdallocx/dallocx). fn_count 0: glibc's, found by
 * the agent (dlsym RTLD_NEXT). Written by the loader before the agent loads. */
#define MT_INJ_FN_MAX 40
#define MT_INJ_FN_PRIMARY 0x100u /* role: the role's own function (malloc of the allocator, je_malloc) */
struct mt_inj_fn {
	uint64_t addr; /* its entry in the target */
	uint32_t role; /* enum mt_role (malloc-like, calloc, realloc-like, free-like, ...) | MT_INJ_FN_PRIMARY */
	uint32_t pad;
	char name[48]; /* its symbol: the GOT relocations naming it are rewritten */
};

/* stack_mode: written by the loader before the agent loads. */
enum mt_inj_stack_mode {
	MT_INJ_STACK_NONE = 0,
	MT_INJ_STACK_FP = 1,        /* frame pointers, bounded by the thread's stack */
	MT_INJ_STACK_LIBUNWIND = 2, /* libunwind's unw_backtrace (.eh_frame), FP if libunwind.so.8 is missing */
	MT_INJ_STACK_CFI = 3,       /* the loader's CFI rows (cfi_off), walked by the agent (agent_unwind.c); a walk
	                             * they cannot finish is redone by libunwind (stack_slow), FP without it */
};

/* MT_INJ_STACK_CFI (issue 33): the rows src/unwind builds from .eh_frame
 * for the BPF unwinder (struct mt_unwind_row, bpf/memtrace.h), for every
 * executable file mapping of the process when the loader attached, at
 * cfi_off in the ring's file (after the data area): cfi_mods modules sorted
 * by start, then cfi_rows rows; a module's rows are rows[first, first +
 * count), sorted by pc, a row's pc being the runtime address - bias (one
 * file's rows shared by its mappings). */
struct mt_inj_cfi_mod {
	uint64_t start, end; /* the executable mapping [start, end) */
	uint64_t bias;       /* row pc = address - bias */
	uint32_t first, count;
};

/* ts_mode: written by the loader before the agent loads. */
enum mt_inj_ts_mode {
	MT_INJ_TS_NS = 0,  /* clock_gettime(CLOCK_MONOTONIC) */
	MT_INJ_TS_TSC = 1, /* rdtsc: the kernel's clocksource is the TSC (constant, synchronized) */
};

/* struct mt_inj_rec.w: MT_INJ_COMPACT | flags << 16 | role << 8 | kind
 * (enum mt_kind; flags: MT_F_STACK_TRUNCATED, MT_F_NO_STACK). */
#define MT_INJ_COMPACT 0x80000000u
#define MT_INJ_REC_FREE_BYTES 24    /* w, tid, ts, addr */
#define MT_INJ_REC_ALLOC_BYTES 40   /* + size, stack_id */
#define MT_INJ_REC_REALLOC_BYTES 48 /* + old_addr */
struct mt_inj_rec {
	uint32_t w;
	uint32_t tid;
	uint64_t ts;
	uint64_t addr;
	uint64_t size;
	uint64_t stack_id;
	uint64_t old_addr;
};

/* The loader refreshes heartbeat_ns (CLOCK_MONOTONIC) at every drain; a
 * producer that finds it older than this, and the loader's process
 * (loader_pid) gone, stops writing for good: the loader died without saying
 * so (SIGKILL, OOM). A loader whose process is there but that has not
 * beaten for MT_INJ_STALE_MAX_NS (stopped) is given up on too; one merely
 * starved of CPU on a loaded host is not. Checked every
 * MT_INJ_HEARTBEAT_EVERY records of a thread and whenever the ring is full. */
#define MT_INJ_STALE_NS (3ull * 1000000000ull)
#define MT_INJ_STALE_MAX_NS (30ull * 1000000000ull)
#define MT_INJ_HEARTBEAT_EVERY 4096

struct mt_inj_hdr {
	uint64_t magic;
	uint32_t version;
	uint32_t hdr_bytes;  /* MT_INJ_HDR_BYTES */
	uint64_t data_bytes; /* a power of two */
	uint32_t pid;        /* the target's tgid */
	uint32_t loader_pid;
	uint32_t state;      /* enum mt_inj_state */
	uint32_t stack_mode; /* enum mt_inj_stack_mode */
	uint64_t heartbeat_ns;
	uint32_t ts_mode;      /* enum mt_inj_ts_mode */
	uint32_t hook_flags;   /* MT_INJ_NO_GOT: the agent leaves the GOT slots alone (entry trampolines only; for measuring) */
	/* Written by the agent. */
	uint32_t agent_state;  /* enum mt_inj_agent_state */
	uint32_t stack_used;   /* the enum mt_inj_stack_mode it uses */
	uint32_t slots_hooked; /* GOT slots rewritten (JUMP_SLOT and GLOB_DAT) */
	uint32_t objects_hooked;
	uint64_t drops;        /* records not written: ring full and the loader gone or detached */
	uint64_t full_waits;   /* 50 us naps of a writer that found the ring full (the loader's drain was behind) */
	uint64_t stack_table_full; /* stacks sent again and again: the agent's table of sent stacks is full */
	char agent_error[128];
	uint64_t fork_child_calls; /* calls a fork's child made before the agent's atfork child handler: not recorded */
	uint32_t fn_count;     /* loader: allocator functions given (fns); 0: glibc's */
	uint32_t pad0;
	/* loader: --sample-bytes (issue 34): 0, every call recorded; else the
	 * mean bytes between sampled allocations of a thread (Poisson: each
	 * thread's distance to its next sample is exponential with this mean).
	 * Only sampled blocks are recorded, and frees of the addresses the
	 * agent's sampled-block filter holds (a false positive: a free the
	 * model finds no block for); the loader weights each sampled block of
	 * size s by 1 / (1 - exp(-s / sample_bytes)). */
	uint64_t sample_bytes;
	/* loader: Python frames (issue 32). py_frames 1: the process runs
	 * CPython, and the agent appends the calling thread's Python frames to
	 * each stack record as the BPF walk does (bpf/python.bpf.h, struct
	 * mt_py_proc in memtrace.h says where they are: the thread's own
	 * PyThreadState through the interpreter's TSS key, read here with
	 * pthread_getspecific), and sends each code object's MT_EV_PYCODE
	 * record before the first stack that names it. */
	uint32_t py_frames;
	uint32_t pad2;
	struct mt_py_proc py;
	/* agent: Python stacks cut at MT_MAX_PY_FRAMES; MT_EV_PYCODE records
	 * whose strings were not compact ASCII or unreadable (the loader names
	 * those frames from the process's memory while it lives) */
	uint64_t py_cut;
	/* loader: MT_INJ_STACK_CFI's rows (above); cfi_off 0: none */
	uint64_t cfi_off;
	uint32_t cfi_mods;
	uint32_t cfi_rows;
	/* agent, MT_INJ_STACK_CFI: walks the rows could not finish (a pc no
	 * module or row covers: code mapped after the attach, hand-written
	 * code without CFI; a rule the rows do not carry: signal frames; a
	 * read outside the thread's stack), redone by libunwind; */
	uint64_t stack_slow;
	/* of those, stacks left incomplete (no libunwind: the frames the rows
	 * gave, flagged MT_F_STACK_TRUNCATED) */
	uint64_t stack_cut;
	/* agent, MT_INJ_CFI_VERIFY: walks compared with libunwind's, and those that differed */
	uint64_t stack_verified;
	uint64_t stack_mismatch;
	uint64_t head __attribute__((aligned(64))); /* producers: bytes reserved */
	uint64_t pad1[7];
	uint64_t tail __attribute__((aligned(64))); /* consumer: bytes consumed */
	uint64_t pad3[7];
	/* Entry trampolines (x86-64; entry_count 0 elsewhere): the allocator's
	 * own functions, listed by the agent (libc's definitions, found with
	 * dlsym RTLD_NEXT), whose first instructions the loader patches with a
	 * jmp to the hook while every thread is stopped: calls that do not go
	 * through a GOT slot (ld.so's, a dlsym pointer's, libc's own, a
	 * library's constructor run inside dlopen) reach the hooks too. The
	 * loader relocates the instructions it overwrites into a stub in the
	 * agent's trampoline area (tramp, MT_INJ_TRAMP_BYTES near libc, mapped
	 * read+exec by the agent, written by the loader through
	 * /proc/PID/mem), points the agent's pointer to the original
	 * (real_slot) at the stub, and sets stub. */
	uint64_t tramp;        /* agent: its trampoline area, 0 if none */
	uint32_t entry_count;  /* agent */
	uint32_t entries_patched; /* loader: entries whose jmp is in place (this session or an earlier one) */
	struct mt_inj_entry {
		uint64_t fn;        /* the function's entry (agent) */
		uint64_t hook;      /* where its entry jumps (agent) */
		uint64_t real_slot; /* the agent's pointer the hook calls the original through (agent) */
		uint64_t stub;      /* the stub: 0 until patched; the agent gives an earlier session's (agent, loader) */
		uint64_t orig_slot; /* 65 bytes of the agent's where the loader leaves the entry's first bytes as the
		                     * file has them (32), their count (1) and as it patched them (32): a fork's child
		                     * puts them back (its tracer's uprobes need the original) */
		char name[32];      /* agent */
		uint32_t role;      /* agent: enum mt_role of its hook (where the BPF path would probe it) */
		uint32_t pad;
	} entries[MT_INJ_ENTRY_MAX];
	struct mt_inj_fn fns[MT_INJ_FN_MAX]; /* loader: fn_count of them */
};

#ifdef __cplusplus
static_assert(sizeof(struct mt_inj_hdr) <= MT_INJ_HDR_BYTES, "mt_inj_hdr fits its page");
#else
_Static_assert(sizeof(struct mt_inj_hdr) <= MT_INJ_HDR_BYTES, "mt_inj_hdr fits its page");
#endif

#endif
