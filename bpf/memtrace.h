/* The contract between the BPF programs (bpf/NAME.bpf.c) and the loader
 * (src/loader). Plain C, fixed-width types, fixed-size arrays, no pointers:
 * both sides include this file and nothing about a record layout is written
 * twice (STYLE.md #1). */
#ifndef MEMTRACE_H
#define MEMTRACE_H

#ifndef __VMLINUX_H__
#include <linux/types.h>
#endif

/* Deepest user stack recorded; deeper stacks are cut here and marked
 * truncated (MT_F_STACK_TRUNCATED, MT_C_STACK_TRUNCATED, MT_UC_TRUNC_DEPTH).
 * 64 cut 20% of gdb's stacks, 1.1% of python3's (W1) and 0.6-1.1% of
 * cc1plus's; 128 cuts none of gdb's, python3's or clang's and 0.02-0.46% of
 * cc1plus's, whose deepest recursions go past 512 frames (docs/unwind-perf.md,
 * "Deeper stacks": 256 would still cut 0.15%). A power of 2
 * (masks), at most 256 (the walk memo's frame indexes are bytes). The stack
 * record is variable-size (MT_STACK_BYTES), so the limit costs a shallow
 * stack nothing in the ring buffer. */
#define MT_MAX_FRAMES 128
#define MT_COMM_LEN 16 /* TASK_COMM_LEN: the kernel keeps 15 chars + NUL */
#define MT_MAX_COMMS 16 /* -c filters */

/* Allocator entry points (one probe each; aliases share one). */
enum mt_role {
	MT_ROLE_MALLOC = 0,
	MT_ROLE_CALLOC,
	MT_ROLE_REALLOC,
	MT_ROLE_REALLOCARRAY,
	MT_ROLE_FREE,
	MT_ROLE_POSIX_MEMALIGN,
	MT_ROLE_ALIGNED_ALLOC,
	MT_ROLE_MEMALIGN,
	MT_ROLE_VALLOC,
	MT_ROLE_PVALLOC,
	/* C++ aligned operator new (new, new[], their nothrow forms) of a
	 * runtime that rounds the size up before it calls aligned_alloc
	 * (libstdc++): an entry probe only, no record, no event. It leaves the
	 * size the program asked for in the thread's mt_inflight (role
	 * MT_ROLE_ALIGNED_NEW, depth 0, arg0 = size, sp = its return address
	 * slot); the next allocator entry of the thread takes it if it is an
	 * aligned call made from inside that operator new (a lower return
	 * address slot), and clears it in any case. No return probe: a C++
	 * exception thrown through a frame whose return address a uretprobe
	 * replaced finds no unwind info there and calls std::terminate. */
	MT_ROLE_ALIGNED_NEW,
	/* CPython's own allocator, the `python` domain (issue 32): pymalloc's
	 * functions as the interpreter's allocator structs point to them, with
	 * their ctx first: (ctx, size), (ctx, nelem, elsize), (ctx, ptr, size),
	 * (ctx, ptr). A block they return is the python domain's; a malloc,
	 * realloc or free they make inside (a request past 512 bytes, an arena)
	 * is nested and not counted again. PY_FREE has no return probe: its
	 * entry leaves a mark (role MT_ROLE_PY_FREE, depth 0, arg0 = the
	 * pointer, sp = its return address slot) that the free it makes of the
	 * same pointer from inside (a lower or equal slot: a tail call) finds
	 * and skips. src/python/pymem.h finds the functions. */
	MT_ROLE_PY_MALLOC,
	MT_ROLE_PY_CALLOC,
	MT_ROLE_PY_REALLOC,
	MT_ROLE_PY_FREE,
	MT_ROLE_COUNT,
};
#define MT_ROLE_IS_PY(r) ((r) >= MT_ROLE_PY_MALLOC && (r) <= MT_ROLE_PY_FREE)

/* Ring-buffer record kinds: every record starts with struct mt_hdr. */
enum mt_kind {
	MT_EV_ALLOC = 1,    /* a block came to life: addr, size (realloc: old_addr too) */
	MT_EV_FREE,         /* a block died (free, or the old half of realloc) */
	MT_EV_ALLOC_FAIL,   /* allocator returned NULL / error */
	MT_EV_REALLOC_FAIL, /* realloc(p, n) failed: p is still live (undo its free) */
	MT_EV_MMAP,
	MT_EV_MUNMAP,
	MT_EV_MREMAP,
	MT_EV_BRK,
	MT_EV_STACK,        /* a new distinct stack: struct mt_stack */
	MT_EV_EXEC,         /* process exec'd (new image): stopped, waiting for attach */
	MT_EV_FORK,         /* traced process forked a child: child stopped */
	MT_EV_EXIT,         /* process exited */
	MT_EV_LIBMAP,       /* pending process mapped an executable file: stopped */
	MT_EV_FAULT,        /* user page fault (--faults) */
	MT_EV_MAPFILE,      /* lifecycle ring, system-wide: an executable file mapping (struct mt_map_event) */
	MT_EV_PYCODE,       /* events ring: a Python code object a new stack names (struct mt_py_code) */
};

/* mt_hdr.flags */
#define MT_F_ALLOCATOR_INTERNAL (1u << 0) /* mmap/brk issued inside an allocator call */
#define MT_F_STACK_TRUNCATED (1u << 1)
#define MT_F_NO_STACK (1u << 2)           /* stack not captured (disabled or failed) */
#define MT_F_STOPPED (1u << 3)            /* the task was sent SIGSTOP: loader must SIGCONT */
#define MT_F_FAULT_WRITE (1u << 4)
#define MT_F_FAULT_INSTR (1u << 5)
#define MT_F_VFORK (1u << 6)              /* child shares the parent's mm */
#define MT_F_THREAD (1u << 7)
/* MT_EV_FAULT: the faulting VMA does not allow this access, so the kernel
 * answers with SIGSEGV instead of mapping a page: a page made inaccessible by
 * --rearm (memtrace-singlestep restores it and the access is retried), or a
 * real crash. Set from bpf_find_vma at the fault. */
#define MT_F_FAULT_ACCESS_ERR (1u << 8)
#define MT_F_FAULT_NO_VMA (1u << 9)       /* no VMA at the address (SIGSEGV or stack growth) */
#define MT_F_FAULT_VMA_UNKNOWN (1u << 10) /* VMA lookup not possible (mmap lock busy) */
#define MT_F_EXEC_UNTRACED (1u << 11)     /* MT_EV_EXEC in the events ring: the new image is not traced (-c) */
/* MT_EV_ALLOC / ALLOC_FAIL: size is what the program asked a C++ aligned
 * operator new for, not the (rounded) size that operator passed on. */
#define MT_F_CXX_NEW (1u << 12)
/* MT_EV_EXEC in the lifecycle ring, system-wide: the program has no
 * interpreter (statically linked: its allocator, if any, is in its own file). */
#define MT_F_EXEC_STATIC (1u << 13)
/* --sample-bytes on the BPF path, in mt_inflight.flags only (never sent):
 * the call in flight is not sampled; realloc's old block was not a sampled
 * one (no free was recorded for it, nor may a failure revive it). */
#define MT_F_UNSAMPLED (1u << 14)
#define MT_F_OLD_UNRECORDED (1u << 15)
#define MT_F_BPF_ONLY (MT_F_UNSAMPLED | MT_F_OLD_UNRECORDED)
#define MT_SAMPLE_GAPS 1024 /* exponential gaps the loader computes for --sample-bytes */

/* A file as the kernel names it: its superblock's s_dev (major << 20 | minor)
 * and its inode number (the static_known map). */
struct mt_file_key {
	__u64 dev;
	__u64 ino;
};

struct mt_hdr {
	__u32 kind; /* enum mt_kind */
	__u32 flags;
	__u32 pid;  /* tgid */
	__u32 tid;
	__u64 ts;   /* bpf_ktime_get_ns */
};

/* MT_EV_ALLOC / FREE / ALLOC_FAIL / REALLOC_FAIL / MMAP / MUNMAP / MREMAP / BRK / FAULT;
 * and in the events ring, MT_EV_EXEC (the pid's new image starts here) and
 * MT_EV_FORK (h.pid forked child addr, here in the parent's stream): the
 * order of these among a process's events is exact, which the lifecycle
 * records of the proc_events ring cannot give. */
struct mt_event {
	struct mt_hdr h;
	__u64 addr;     /* block / mapping / new brk / fault address */
	__u64 size;     /* bytes requested / mapping length */
	__u64 old_addr; /* realloc, mremap: previous address; fault: ip */
	__u64 old_size; /* mremap: previous length; mmap: prot<<32 | flags;
			 * fault: x86 error code (bit 0 present/protection, 1 write, 2 user, 4 instr) */
	__u64 stack_id; /* hash of frames (0: none), see MT_EV_STACK */
	__u32 role;     /* enum mt_role for allocator events */
	__u32 aux;      /* mmap: fd (or -1) */
};

/* MT_EV_STACK: sent once per distinct stack (deduplicated in BPF by hash).
 * Variable-size: the record holds the header and ips[0..nr), exactly
 * MT_STACK_BYTES(nr) bytes (1 <= nr <= MT_MAX_FRAMES); the struct is the
 * largest record (BPF's per-CPU scratch). */
/* Python frames (issue 32): a stack of a process in py_procs (the loader
 * found CPython in it) carries, after its nr native frames, py_nr pairs
 * ips[nr + 2i] = the code object's address, ips[nr + 2i + 1] = the frame's
 * prev_instr | MT_PY_ENTRY if it is an entry frame (the first frame a
 * _PyEval_EvalFrameDefault call ran: the splice's boundary), innermost
 * first; the record is MT_STACK_BYTES(nr + 2 * py_nr) bytes and stack_id
 * hashes the pairs too. At most MT_MAX_PY_FRAMES: deeper Python stacks are
 * cut (MT_C_PY_CUT). The loader splices them into the native frames before
 * the heap model or a recording sees the record (src/python): what those
 * get has py_nr 0. */
#define MT_MAX_PY_FRAMES 64
#define MT_PY_ENTRY (1ull << 63)
/* (0, MT_PY_SHIM): the shim frame below an entry frame (3.13, MT_PYP_OWNER):
 * the pair before it is the entry frame's; the splice drops it. */
#define MT_PY_SHIM (1ull << 62)
struct mt_stack {
	struct mt_hdr h;
	__u64 stack_id;
	__u32 nr;       /* native frames used */
	__u32 py_nr;    /* Python frame pairs after them */
	__u64 ips[MT_MAX_FRAMES + 2 * MT_MAX_PY_FRAMES]; /* innermost first; ips[0] is the probed function's caller's call site */
};
#define MT_STACK_HDR_BYTES 40 /* offsetof(struct mt_stack, ips) */
#define MT_STACK_BYTES(nr) (MT_STACK_HDR_BYTES + 8 * (nr))
#ifdef __cplusplus
#define MT_STATIC_ASSERT static_assert
#else
#define MT_STATIC_ASSERT _Static_assert
#endif
MT_STATIC_ASSERT(__builtin_offsetof(struct mt_stack, ips) == MT_STACK_HDR_BYTES, "mt_stack header");
MT_STATIC_ASSERT((MT_MAX_FRAMES & (MT_MAX_FRAMES - 1)) == 0 && MT_MAX_FRAMES <= 256, "MT_MAX_FRAMES");
/* The pairs' slots are masked with MT_STACK_SLOTS - 1 in BPF. */
#define MT_STACK_SLOTS (MT_MAX_FRAMES + 2 * MT_MAX_PY_FRAMES)
MT_STATIC_ASSERT((MT_STACK_SLOTS & (MT_STACK_SLOTS - 1)) == 0, "MT_STACK_SLOTS");

/* py_procs map value, keyed by tgid: where a CPython process keeps its
 * frames, for the BPF walk at each allocator hit (x86-64). The thread's own
 * PyThreadState (not the GIL holder's: a C extension allocates with the GIL
 * released) is the value of the interpreter's TSS key in glibc's TSD:
 *   key = *(int *)(tss_addr + 4) once *(int *)tss_addr (_is_initialized);
 *   tstate = *(fsbase + tsd_off + key * 16 + 8)   (keys < 32: specific_1stblock)
 * then frame = *(*(tstate + tstate_cframe) + cframe_current) and along
 * frame + frame_previous. Offsets of a frame's fields are from frame_window,
 * the start of the one read per frame (MT_PY_WINDOW bytes). */
#define MT_PY_WINDOW 40
#define MT_PY_WINDOW_OWNER 72 /* MT_PYP_OWNER's (3.13: f_executable at 0 .. owner at 70) */
struct mt_py_proc {
	__u64 tss_addr;       /* &_PyRuntime.autoTSSkey (3.11: _PyRuntime + 592) */
	__u32 tsd_off;        /* glibc's struct pthread.specific_1stblock (2.36 x86-64: 0x310) */
	__u16 tstate_cframe;  /* PyThreadState.cframe (3.11: 56) */
	__u16 cframe_current; /* _PyCFrame.current_frame (8) */
	__u16 frame_window;   /* first byte read of a _PyInterpreterFrame (f_code: 32) */
	__u8 w_code;          /* in the window: f_code (0) */
	__u8 w_previous;      /* previous (16) */
	__u8 w_prev_instr;    /* prev_instr (24) */
	__u8 w_is_entry;      /* is_entry (36); MT_PYP_OWNER: owner (3.13: 70 - 0) */
	__u8 flags;           /* MT_PYP_* */
	__u8 owner_cstack;    /* MT_PYP_OWNER: the owner value of an entry's shim frame */
	/* Code objects (MT_EV_PYCODE): PyCodeObject's fields, a compact ASCII
	 * str's characters, a bytes object's size and bytes. */
	__u16 co_firstlineno, co_filename, co_qualname, co_linetable;
	__u16 str_state, str_ascii_data, bytes_size, bytes_data;
	__s32 tls_off;        /* MT_PYP_TLS: tstate = *(fsbase + tls_off) (3.13's _Py_tss_tstate) */
	__u32 pad;
};
/* 3.12+ (3.13 done): the thread state is a TLS variable of the executable
 * (tss_addr, tsd_off unused); */
#define MT_PYP_TLS 1
/* no _PyCFrame: frame = *(tstate + tstate_cframe) (3.13's current_frame); */
#define MT_PYP_NO_CFRAME 2
/* no is_entry: a frame whose owner byte (at w_is_entry) is owner_cstack is
 * the shim a _PyEval_EvalFrameDefault call puts below its first frame: not
 * a Python frame, it is sent as a pair (0, MT_PY_SHIM). */
#define MT_PYP_OWNER 4

/* MT_EV_PYCODE: sent with a new stack (before it, same CPU: in ring order)
 * for each of its code objects that this tgid has not sent with its
 * fingerprint (code_seen: first line, name and file pointers; an address
 * a freed code object left to another gets another record). The loader
 * names frames from these, never from the process's memory, which may be
 * gone by the time it drains the ring. name and file are compact ASCII
 * strs (MT_PYC_NONASCII: one is not), cut at their sizes (NUL-ended); the
 * location table is cut at MT_PY_TABLE_LEN (MT_PYC_TABLE_CUT: lines of
 * instructions past the cut are unknown). Fixed size. */
#define MT_PY_NAME_LEN 128
#define MT_PY_FILE_LEN 256
#define MT_PY_TABLE_LEN 2048 /* power of 2 */
#define MT_PYC_NONASCII 1
#define MT_PYC_TABLE_CUT 2
#define MT_PYC_UNREADABLE 4  /* the code object's strings or table could not be read */
struct mt_py_code {
	struct mt_hdr h;
	__u64 code;
	__s32 first_line;
	__u32 flags;      /* MT_PYC_* */
	__u32 table_len;  /* bytes of table used */
	__u32 pad;
	char name[MT_PY_NAME_LEN];
	char file[MT_PY_FILE_LEN];
	__u8 table[MT_PY_TABLE_LEN];
};
struct mt_py_code_key {
	__u32 tgid;
	__s32 first_line;
	__u64 code, name, file;
};

/* MT_EV_EXEC / FORK / EXIT / LIBMAP */
struct mt_proc_event {
	struct mt_hdr h;
	__u32 ppid;      /* EXEC with MT_F_EXEC_STATIC: the program file's s_dev (as mt_file_key's) */
	__s32 exit_code; /* EXIT: wait status style (code<<8 | sig) */
	__u64 addr;      /* LIBMAP: start of the new mapping; EXEC: the exec's id (its time, as in the events ring's MT_EV_EXEC) */
	__u64 len;       /* EXEC with MT_F_EXEC_STATIC: the program file's inode */
	char comm[MT_COMM_LEN];
};

/* MT_EV_MAPFILE (lifecycle ring, system-wide only): executable code of a
 * file as the kernel mapped it, sent with the exec (the program: is_exe,
 * path = the file executed, start/end = mm's start_code and end_code) and
 * with each executable file mmap (a library: start, end, pgoff, and in
 * path only the file's own name (its dentry's, no directory, at most
 * MT_MAP_NAME_LEN - 1 bytes: longer names are cut); the record ends there:
 * MT_MAP_EVENT_LIB_BYTES). System-wide, new processes are never stopped:
 * one that exits before the loader has read its /proc/PID/maps gets its
 * address space from these (the file found by dev and inode among the
 * files mapped elsewhere, else by its name in the program's RUNPATH and
 * ld.so's directories, checked by dev and inode; the program by its exec
 * path). Not in recordings: REC_MAPS keeps what they resolved to. */
#define MT_MAP_PATH_LEN 256
#define MT_MAP_NAME_LEN 48
struct mt_map_event {
	struct mt_hdr h;
	__u64 start, end; /* runtime range */
	__u64 pgoff;      /* library: file offset of start (bytes); exe: 0 (the loader reads the ELF) */
	__u64 ino;        /* inode of the file (0: not found) */
	__u32 dev;        /* its superblock's kernel dev_t: MAJOR << 20 | MINOR */
	__u32 is_exe;
	char path[MT_MAP_PATH_LEN];
};
#define MT_MAP_EVENT_NAME_OFF 64 /* offsetof(struct mt_map_event, path) */
#define MT_MAP_EVENT_LIB_BYTES (MT_MAP_EVENT_NAME_OFF + MT_MAP_NAME_LEN)
MT_STATIC_ASSERT(__builtin_offsetof(struct mt_map_event, path) == MT_MAP_EVENT_NAME_OFF, "mt_map_event");

/* targets map value: why a process is traced and where it stands. */
enum mt_target_state {
	MT_TS_TRACED = 1,   /* uprobes attached for this process's mm */
	MT_TS_PENDING = 2,  /* exec'd or forked: no allocator attached yet; stop it at new exec mappings */
	MT_TS_SHARED_MM = 3,/* vfork child running on the parent's mm: traced through the parent */
};

#define MT_FOLLOW_CHILDREN 1 /* follow children */
#define MT_FOLLOW_NO_STOP 2  /* a process given by -p: never stopped by BPF (its
			      * parent, a shell maybe, did not start it under us) */

struct mt_target {
	__u32 state;
	__u32 follow; /* MT_FOLLOW_* bits */
	__u32 image;  /* execs of this process under tracing: its probes' cookies carry it */
	__u32 pad;
};

/* Allocator probe cookies: role | ret_at << 8 | image << MT_COOKIE_IMAGE_SHIFT.
 * A per-process uprobe follows the task, not its mm: after an exec the old
 * image's probes (closed by the loader in the background: ~100 ms each)
 * would fire in the new image beside its own. The BPF side ignores a probe
 * whose image is not the process's current one. */
#define MT_COOKIE_IMAGE_SHIFT 40
/* The image of a probe shared by every process (one perf-event uprobe per
 * file offset, each process in its filter: src/loader/shared_uprobes.h):
 * one probe fires once whatever image put the process in the filter, so a
 * hit is always the current image's. */
#define MT_COOKIE_IMAGE_SHARED 0xffffffu
#define MT_IMAGE_ANY 0xffffffffu

/* Per-thread state of an allocator call in flight (nested public calls from
 * inside glibc are counted once: only the outermost call emits). */
struct mt_inflight {
	__u64 sp;       /* rsp at the outermost entry: a later entry with a higher sp is stale */
	__u64 arg0;     /* size / old ptr / memptr */
	__u64 arg1;
	__u64 stack_id;
	__u32 role;
	__u32 depth;
	__u32 flags;
	__u32 img;      /* the thread's process's current image (or MT_IMAGE_ANY) ... */
	__u64 img_mm;   /* ... while its mm is this one (0: look it up again) */
	__s64 sample_left; /* --sample-bytes: bytes to this thread's next sample (0: none drawn yet) */
};

/* Per-syscall state between sys_enter and sys_exit (mmap, mremap, brk). */
struct mt_sysargs {
	__u64 a0, a1, a2, a3;
	__u32 internal;
	__u32 pgoff_pages; /* mmap: the file offset in pages (system-wide) */
};

/* Counters (index into the per-CPU counters array), shown as "dropped" and
 * "stats" in every report. Nothing is lost silently. */
enum mt_counter {
	MT_C_RINGBUF_FULL = 0,  /* event records that did not fit the ring buffer */
	MT_C_STACK_RINGBUF_FULL,/* stack records that did not fit */
	MT_C_INFLIGHT_FULL,     /* inflight map full: call not tracked */
	MT_C_STACK_EMPTY,       /* stack capture returned nothing */
	MT_C_STACK_TRUNCATED,   /* stack cut (MT_MAX_FRAMES, or a frame the walk could not recover) */
	MT_C_NESTED,            /* nested allocator entries skipped (informational) */
	MT_C_STALE_INFLIGHT,    /* inflight record found stale (missed return) */
	MT_C_SIGNAL_FAIL,       /* process not stopped for attach: bpf_send_signal failed or the stopped map is full */
	MT_C_SYSARGS_FULL,
	MT_C_FAULTS_FILTERED,   /* informational: faults of the loader itself (system-wide --faults) */
	MT_C_FAULT_RINGBUF_FULL,/* fault records that did not fit the ring buffer */
	MT_C_FAULT_VMA_BUSY,    /* fault recorded without its VMA check (mmap lock busy):
				 * MT_F_FAULT_VMA_UNKNOWN, informational */
	/* Python frames (py_procs): */
	MT_C_PY_NO_TSTATE,      /* informational: a hit on a thread with no PyThreadState
				 * (interpreter not initialized yet, a thread Python never ran) */
	MT_C_PY_READ_FAILED,    /* the thread state or a frame could not be read: Python frames lost */
	MT_C_PY_CUT,            /* Python stack cut at MT_MAX_PY_FRAMES */
	MT_C_PY_CODE_RINGBUF_FULL, /* MT_EV_PYCODE records that did not fit: frames of it named "?" */
	MT_C_CHAIN_FALLBACK,    /* informational: a compat CFI chain (unwind_chain.bpf.h) could not resume its entry: frame-pointer stack */
	MT_C_COUNT,
};

/* ------------------------------------------------------------------------
 * CFI unwinding (issue 5): tables built from .eh_frame/.debug_frame by
 * src/unwind, used by bpf/unwind.bpf.h. Additive block: nothing above
 * depends on it.
 * ---------------------------------------------------------------------- */

/* How to find the CFA (the caller's rsp) at a pc. The return address is
 * always at CFA-8 on x86-64 (rows where it is not are UNSUPPORTED). */
enum mt_cfa_type {
	MT_CFA_NONE = 0,        /* no CFI covers this pc: frame-pointer fallback */
	MT_CFA_RSP = 1,         /* CFA = rsp + cfa_off */
	MT_CFA_RBP = 2,         /* CFA = rbp + cfa_off */
	MT_CFA_RBP_DEREF = 3,   /* CFA = *(rbp + cfa_off): gcc's stack-realigning functions (main with AVX) */
	MT_CFA_PLT = 4,         /* .plt expression: CFA = rsp + 8 + ((pc & 15) >= cfa_off ? 8 : 0) */
	MT_CFA_END = 5,         /* return address undefined: outermost frame (_start, clone3) */
	MT_CFA_UNSUPPORTED = 6, /* any other expression or register: unwinding stops (truncated) */
};

/* How to recover the caller's rbp. */
enum mt_rbp_rule {
	MT_RBP_SAME = 0,    /* unchanged */
	MT_RBP_AT_CFA = 1,  /* rbp = *(CFA + rbp_off) */
	MT_RBP_AT_RBP = 2,  /* rbp = *(rbp + rbp_off) (DW_CFA_expression breg6) */
	MT_RBP_UNKNOWN = 3, /* lost: frame-pointer fallback impossible above this frame */
};

/* One row of a file's table: applies from pc to the next row's pc. Rows of
 * one file are consecutive in the row space (unwind_shards) and sorted by pc; pc is
 * relative to the table base (row pc = ELF vaddr - base), so 32 bits.
 * 8 bytes (an array map strides values by 8): offsets are stored divided
 * by 8 (x86-64 frames move rsp by pushes and 8-aligned subs); a value that
 * does not fit makes the row MT_CFA_UNSUPPORTED / MT_RBP_UNKNOWN. */
struct mt_unwind_row {
	__u32 pc;
	__s16 cfa_off; /* CFA offset / 8; MT_CFA_PLT: the threshold itself */
	__u8 kind;     /* enum mt_cfa_type | enum mt_rbp_rule << 4 */
	__s8 rbp_off;  /* rbp save slot offset / 8 */
};
#define MT_ROW_CFA(r) ((r)->kind & 15)
#define MT_ROW_RBP(r) ((r)->kind >> 4)

/* arm64 rows (issue 20): the same 8 bytes, read with other register names.
 * The return address is not at CFA-8 there: bl leaves it in x30, and a
 * function that calls saves x30 where its prologue says (stp x29, x30,
 * [sp, #-32]!: x29 at CFA-32, x30 at CFA-24).
 *   kind & 15      enum mt_cfa_type on sp (MT_CFA_RSP: DWARF 31) or x29
 *                  (MT_CFA_RBP: DWARF 29); MT_CFA_RBP_DEREF and MT_CFA_PLT
 *                  are not made: a .plt stub is MT_CFA_RSP + 0, x30 in
 *                  its register (no CFI, nothing pushed)
 *   kind >> 4 & 3  enum mt_rbp_rule for x29, MT_RBP_AT_RBP read as
 *                  MT_X29_AT_BASE_ARM64 (below)
 *   kind >> 6      enum mt_ra_rule_arm64: where x30, the return address, is
 *   cfa_off        CFA offset / 8, as on x86-64
 *   rbp_off        / 8: the save slot of x29 (MT_RBP_AT_CFA, x30 maybe
 *                  right above it) or of x30 alone (MT_RA_AT_CFA), from the
 *                  CFA; or, for the _AT_BASE rules, from the register the
 *                  CFA is on (CFA - cfa_off * 8: sp or x29). gcc puts the
 *                  frame record at the bottom of a frame (sub sp, sp,
 *                  #4304; stp x29, x30, [sp]: x29 at CFA-4304, sp + 0),
 *                  clang near its top: the one that fits the byte is kept.
 * Pointer authentication: return addresses read by the walk are masked to
 * the user VA bits (MT_ARM64_VA_MASK), whatever DW_CFA_AARCH64_negate_ra_state
 * said (parsed, not needed). */
enum mt_ra_rule_arm64 {
	MT_RA_REG = 0,     /* in x30 (the CIE's default: entry, leaf, PLT): known in the first frame only */
	MT_RA_PAIR = 1,    /* right above x29's slot: saved with it (stp x29, x30); x29 saved (_AT_CFA or _AT_BASE) */
	MT_RA_AT_CFA = 2,  /* at CFA + rbp_off * 8; x29 not saved in this frame (MT_RBP_SAME or UNKNOWN) */
	MT_RA_AT_BASE = 3, /* at CFA + (rbp_off - cfa_off) * 8; x29 not saved either */
};
#define MT_X29_AT_BASE_ARM64 MT_RBP_AT_RBP /* x29 at CFA + (rbp_off - cfa_off) * 8 */
#define MT_ROW_X29_ARM64(r) (((r)->kind >> 4) & 3)
#define MT_ROW_RA_ARM64(r) ((r)->kind >> 6)
/* User addresses on arm64 Linux (48-bit VA; the bits above hold a PAC or a
 * tag): a return address signed by paciasp is stripped with it. */
#define MT_ARM64_VA_MASK 0x0000ffffffffffffULL

/* Rows live in shards of 2^MT_UNWIND_SHARD_BITS rows (2 MiB), added by
 * the loader as files need them: no fixed global limit; the loader caps
 * their sum (--unwind-mb). Global row numbers are 32 bits. */
#define MT_UNWIND_SHARD_BITS 18
#define MT_UNWIND_SHARD_MASK ((1u << MT_UNWIND_SHARD_BITS) - 1)
#define MT_UNWIND_MAX_SHARDS 8192 /* 16 GiB of rows: the 32-bit row space / 2 */
/* Rows of one file: at most 2^MT_UNWIND_ROW_BITS (the BPF binary search's
 * steps; 16M rows, 128 MiB). */
#define MT_UNWIND_ROW_BITS 24
/* Executable mappings per process (binary search mask: power of 2). */
#define MT_UNWIND_MAX_MAPPINGS 256
/* Processes with tables (hash, not preallocated). */
#define MT_UNWIND_MAX_PROCS 4096

/* One executable mapping of a process: row pc = addr - bias. nr_rows == 0:
 * the file has no CFI (frame-pointer fallback inside it). */
struct mt_unwind_mapping {
	__u64 start;
	__u64 end;
	__u64 bias;
	__u32 first_row; /* global row number (shard << MT_UNWIND_SHARD_BITS | index) */
	__u32 nr_rows;
};

/* unwind_procs map value, keyed by tgid; m[] sorted by start. gen: unique
 * per published value (never 0), so (gen, pc) names one row for as long as
 * the value is in the map: the BPF side caches rows by it. */
struct mt_unwind_proc {
	__u32 nr;
	__u32 gen;
	struct mt_unwind_mapping m[MT_UNWIND_MAX_MAPPINGS];
};

/* unwind_files map: every file whose rows are loaded, by the kernel's
 * identity of it (the superblock's dev_t as the kernel encodes it,
 * MAJOR << 20 | MINOR, and the inode number). The BPF walk uses it for a pc
 * that no published mapping of its process covers (a process the loader has
 * not read yet, a library mapped since): the kernel's own VMA of the pc
 * (bpf_find_vma) names the file and its offset, this entry its rows. */
struct mt_unwind_file_key {
	__u64 dev;
	__u64 ino;
};
#define MT_UNWIND_FILE_SEGS 4 /* executable PT_LOADs of a file (one, nearly always) */
struct mt_unwind_file_seg {
	__u64 off_lo;  /* p_offset rounded down to its page */
	__u64 off_hi;  /* p_offset + p_filesz */
	__u64 delta;   /* p_vaddr - p_offset (mod 2^64) */
};
struct mt_unwind_file {
	__u64 base;      /* row pc = ELF vaddr - base */
	__u32 first_row; /* global row number */
	__u32 nr_rows;
	__u32 nseg;
	__u32 pad;
	struct mt_unwind_file_seg seg[MT_UNWIND_FILE_SEGS];
};

/* unwind_counters (per-CPU array): frames by method, and why stacks ended. */
enum mt_unwind_counter {
	MT_UC_STACKS = 0,        /* stacks unwound */
	MT_UC_FRAMES_CFI,        /* frames recovered from a table row */
	MT_UC_FRAMES_FP,         /* frames recovered by the frame-pointer fallback */
	MT_UC_END_OUTERMOST,     /* reached a frame with undefined return address (complete) */
	MT_UC_END_ZERO,          /* return address 0 or frame-pointer chain ended (rbp 0) */
	MT_UC_TRUNC_DEPTH,       /* MT_MAX_FRAMES reached */
	MT_UC_TRUNC_NO_TABLE,    /* pc without row and no usable frame pointer */
	MT_UC_TRUNC_UNSUPPORTED, /* row is MT_CFA_UNSUPPORTED (or rbp lost when needed) */
	MT_UC_TRUNC_READ,        /* bpf_probe_read_user of return address / rbp failed */
	MT_UC_TRUNC_BAD_FRAME,   /* CFA not above rsp (corrupt or looping stack) */
	MT_UC_MEMO_HITS,         /* of MT_UC_STACKS: replayed from the walk memo, not walked */
	MT_UC_ROWS_VMA,          /* row lookups answered through the pc's VMA and unwind_files
				  * (no published mapping covered the pc) */
	MT_UC_COUNT,
};

#endif /* MEMTRACE_H */
