/* CFI unwinder, part 1 of 4 (included by unwind.bpf.h, in this order):
 * the maps user space fills (rows in shards, processes, files), the per-CPU
 * caches, the stack window and the walk memo's entry, and the window reads
 * (mt_uread16). */
#ifndef MT_UNWIND_STATE_BPF_H
#define MT_UNWIND_STATE_BPF_H

/* The unwinder's global functions (verified once, whatever their caller's
 * state) and its bpf_loop loops. The compat object (5.10-5.16) has
 * neither: before 5.12 a global function takes no pointer but ctx, and
 * bpf_loop is 5.17; there they are static BPF functions, verified at each
 * call, and bounded loops (unwind_rows.bpf.h, unwind_chain.bpf.h). */
#ifdef MT_COMPAT
#define MT_GLOBAL static __attribute__((noinline))
#else
#define MT_GLOBAL __attribute__((noinline))
#endif

/* Stack id: FNV-style hash of ips[0..nr), innermost first (0 -> 1). */
#define MT_HASH_SEED 0xcbf29ce484222325ULL
static __always_inline __u64 mt_hash_step(__u64 h, __u64 ip)
{
	h ^= ip;
	h *= 0x100000001b3ULL;
	return h ^ (h >> 29);
}

/* The rows of every file, in shards: row i is entry i & MT_UNWIND_SHARD_MASK
 * of the array map in slot i >> MT_UNWIND_SHARD_BITS of unwind_shards. A
 * file's rows are consecutive (they may cross shards). The loader adds
 * shards as files need them (each addition of a map to a map-in-map waits
 * for an RCU grace period, ~7 ms here, so shards are big and few, and the
 * first ones are added before anything is attached) and drops empty ones;
 * no fixed global row limit: libLLVM alone has ~2M rows. */
/* Sizes, not BTF types: a shard the loader creates has no BTF, and kernels
 * before 6.2 compare the inner maps' BTF-derived fields (timer_off) with
 * the template's, so a template with BTF made every insertion EINVAL (6.1). */
struct mt_rows_shard {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1u << MT_UNWIND_SHARD_BITS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(struct mt_unwind_row));
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MT_UNWIND_MAX_SHARDS);
	__type(key, __u32);
	__array(values, struct mt_rows_shard);
} unwind_shards SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MT_UNWIND_MAX_PROCS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32); /* tgid */
	__type(value, struct mt_unwind_proc);
} unwind_procs SEC(".maps");

/* Files whose rows are loaded, by (dev, inode) (struct mt_unwind_file):
 * written by the loader as it loads and frees rows. For a pc no published
 * mapping covers, the walk asks the kernel for the pc's VMA and finds the
 * rows here, so a process is unwound by tables from its first allocation,
 * before the loader has read its mappings (system-wide, a build's short
 * processes often exit before that), as long as the files it maps are
 * loaded for some other process (or were, in the last kKeepSeconds). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct mt_unwind_file_key);
	__type(value, struct mt_unwind_file);
} unwind_files SEC(".maps");

/* A process with no published value walks with an empty one (no mappings:
 * every row from its VMAs), stamped with a gen of its own for the row
 * caches: 0x80000000 | cpu << 24 | a per-CPU count (the loader's gens
 * count up from 1 and stay far below), made once per process image and
 * dropped at its exec and exit. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32); /* tgid */
	__type(value, __u32);
} unwind_lazy_gen SEC(".maps");

struct mt_unwind_noproc {
	struct mt_unwind_proc p; /* nr 0; gen: the walking process's */
	__u32 next;              /* this CPU's count of gens made */
	__u32 pad;
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_unwind_noproc);
} unwind_noproc SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
#ifdef MT_UNWIND_CACHE_STATS
	/* + -, L1 hits, L1 misses, refills, span bytes, (unused x3), replays
	 * that found a word changed */
	__uint(max_entries, MT_UC_COUNT + 9);
#else
	__uint(max_entries, MT_UC_COUNT);
#endif
	__type(key, __u32);
	__type(value, __u64);
} unwind_counters SEC(".maps");

static __always_inline void mt_unwind_add(__u32 c, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&unwind_counters, &c);
	if (v)
		*v += n;
}
#define mt_unwind_count(c) mt_unwind_add((c), 1)

/* Row caches: unwind_rc (L1, 1024 entries, below) and this larger
 * direct-mapped per-CPU array (L2), both keyed by (lookup pc, gen), in
 * front of the two binary searches (~1 us). */
#define MT_UNWIND_CACHE_ENTRIES 8192 /* power of 2 */

/* Row cache entry: the row found for a lookup pc under one published
 * mt_unwind_proc (gen). gen is unique per published value and never 0, so a
 * zeroed or stale entry cannot match: the cache is exact. */
struct mt_unwind_cache_ent {
	__u64 pc;  /* lookup pc */
	__u32 gen; /* mt_unwind_proc.gen it was found under */
	__u32 pad;
	struct mt_unwind_row row; /* kind MT_CFA_NONE: no row */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MT_UNWIND_CACHE_ENTRIES);
	__type(key, __u32);
	__type(value, struct mt_unwind_cache_ent);
} unwind_row_cache SEC(".maps");

/* Stack window (per CPU): one bpf_probe_read_user of MT_UNWIND_WIN_BYTES (2 KiB: W1 722 ns per probe call vs 819 with 1 KiB, 733 with 4 KiB)
 * serves the following frames' reads (return address, saved rbp) while they
 * fall inside it; a read outside it refills the window at that address.
 * Each user read costs ~60 ns of fixed overhead (usercopy checks), far more
 * than copying 2 KiB, and a stack's frames are usually within a few KiB.
 * Near the top of a stack (the mapping ends) the window is clamped to the
 * page of the address. base/len describe what w[] holds for this stack
 * only: len is reset at the start of every walk. */
#ifndef MT_UNWIND_WIN_BYTES /* (-D for A/B builds: 8 KiB made no measurable difference on W1 or W3) */
#define MT_UNWIND_WIN_BYTES 2048 /* power of 2, multiple of 8 */
#endif
#define MT_UNWIND_WIN_WORDS (MT_UNWIND_WIN_BYTES / 8)
/* The window's buffer: larger than a walk's refill, for a memo replay's
 * planned refills (mt_memo_plan), which read a whole cluster of recorded
 * words at once. */
#define MT_UNWIND_BUF_BYTES 8192 /* power of 2, >= MT_UNWIND_WIN_BYTES */
#define MT_UNWIND_BUF_WORDS (MT_UNWIND_BUF_BYTES / 8)
#ifndef MT_UNWIND_RC_ENTRIES
#define MT_UNWIND_RC_ENTRIES 1024 /* power of 2; 24 KiB: a per-CPU value stays under 32 KiB */
#endif
#define MT_UNWIND_WIN_SLACK 64 /* bytes below a refill address also read (multiple of 8) */
/* First-read hints, direct-mapped by (tgid, rsp, ret_at): how many bytes
 * from the probe's rsp the last stack taken there needed in its first read
 * (its memo entry's first_len). Only a length: a wrong or stale hint costs a
 * copy or some bytes, never a wrong stack. */
#define MT_FIRST_HINTS 512 /* power of 2 */
/* In and out of mt_unwind_walk (scalars only: the pointers are arguments). */
struct mt_walk_io {
	__u64 pc, sp, bp; /* in: first frame's pc, rsp, rbp */
	__u64 h;          /* in/out: stack hash so far */
	__u32 gen;        /* in: mt_unwind_proc.gen */
	__u32 exact_pc;   /* in: pc is not a return address */
	__u32 n;          /* in/out: frames in out->ips */
	__u32 reason;     /* out */
	__u32 frames_fp;  /* out */
	__u32 pad;
#ifdef __TARGET_ARCH_arm64
	__u64 lr;         /* in: x30 at a probe that is not at an entry (the first
			   * frame may be a leaf or a .plt stub: MT_RA_REG), else 0 */
#endif
};

/* What a memo entry is keyed by, and what mt_memo_lookup found (global
 * functions take at most five arguments). */
struct mt_memo_key {
	__u64 sp, bp;   /* rsp, rbp at the probe */
	__u64 pc;       /* first frame */
	__s32 ret_at;
	__u32 epoch;
	__u32 tgid;
	__u32 slot;     /* in: first way of the set; out: the way to record into */
	__u32 nr, frames_fp, reason; /* out, on a hit */
	__u32 first_len;             /* out, on a hit: the entry's first read */
};

struct mt_unwind_win {
	__u64 base;
	__u64 len;
	__u64 floor; /* rsp at the probe: the stack is readable from here up */
	__u64 top;   /* main thread: end of the page holding mm->start_stack (readable up to it); else 0 */
	__u64 clock; /* stacks taken on this CPU (the memo's LRU clock) */
	__u64 base0, len0; /* the window before the memo replay or the walk */
	__u16 first_hint[MT_FIRST_HINTS];
	/* mt_unwind_cfi's state across its global calls, here rather than on
	 * the BPF stack: before 6.x (6.1, 6.12) the verifier sums the frames
	 * of a whole call chain, bpf_loop callbacks included, against 512
	 * bytes, and the probe's own frame is the largest of them. */
	struct mt_walk_io io;
	struct mt_memo_key key;
	__u64 w[MT_UNWIND_BUF_WORDS + 2]; /* +2: a 16-byte read at the last slot */
};
/* Row cache (L1), direct-mapped by lookup pc: allocation stacks repeat the
 * same return addresses, so most frames skip both binary searches. Its
 * size decides the cost: 24 KiB contiguous stays in L1/L2, where an
 * 8192-entry per-CPU array map (196 KiB, one pointer chase per lookup)
 * cost two cache misses per frame (W1: ~35 ns of a ~50 ns frame step).
 * W1: 99% of lookups hit. */
struct mt_unwind_rc {
	struct mt_unwind_cache_ent e[MT_UNWIND_RC_ENTRIES];
};
struct mt_unwind_pair {
	__u64 a, b;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_unwind_win);
} unwind_win SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_unwind_rc);
} unwind_rc SEC(".maps");

/* Walk memo (per CPU, MT_MEMO_WAYS-way set-associative, keyed by the
 * probe's rsp and first frame): what the last walks from there read and
 * found. A walk is a function of the probe's
 * registers (rsp; rip at a non-entry probe; rbp when a row or the
 * frame-pointer fallback used it before a saved rbp replaced it), the rows
 * (named by mt_unwind_proc.gen) and the stack words it read. If all of those
 * are the same now, so is the stack: a hit re-reads the recorded words from
 * the stack (same window reads as the walk) and compares them, then copies
 * the return addresses out, instead of one bpf_loop step per frame with its
 * row lookup. Exact, like the row caches: any difference is a miss and the
 * walk runs (and replaces the entry). Walks that read more than
 * MT_MEMO_WORDS words, or failed a read, are not kept. */
#ifndef MT_MEMO_ENTRIES
#define MT_MEMO_ENTRIES 1024 /* power of 2; the most the loader asks for */
#endif
/* Words a walk may read and still be kept: at least one per frame (the
 * return address), so MT_MAX_FRAMES, or the deepest stacks (cc1plus's and
 * gdb's 65-128 frames, python3's) would be walked every time. */
#define MT_MEMO_WORDS MT_MAX_FRAMES /* power of 2 */
#define MT_MEMO_F_BP 1 /* keyed by the probe's rbp too */
struct mt_memo_ent {
	__u64 sp;       /* rsp at the probe */
	__u64 ip;       /* first frame: the return address at an entry probe, else rip */
	__u64 bp;       /* rbp at the probe (MT_MEMO_F_BP), else 0 */
	__u64 stack_id; /* mt_stack_hash of the result */
	__u64 used;     /* unwind_win.clock when last hit or written (LRU of a set's ways) */
	__u32 gen;      /* unwind_epoch when written; 0: empty or being written */
	__u32 tgid;
	__s32 ret_at;
	__u32 nw;       /* words recorded */
	__u32 nr;       /* frames of the result */
	__u32 flags;    /* MT_MEMO_F_* */
	__u16 reason;   /* enum mt_unwind_counter that ended the walk */
	__u16 frames_fp;
	/* While recording (in the entry, not in the walk's context: loaded
	 * from map memory they are unknown numbers to the verifier, which
	 * otherwise checks the frame step once per combination of values). */
	__u32 ra_k;     /* word index of the return address just read */
	__u32 bp_mem;   /* rbp was read from the stack (not the probe's) */
	__u32 bp_rec;   /* ... and that word is recorded already */
	__u32 bp0_used; /* the walk used the probe's rbp */
	__u64 bp_addr;  /* where rbp was read from */
	__u32 plan_cur; /* mt_memo_plan's state */
	__u16 first_len;/* bytes of the first read (from base0) that hold the first cluster; 0: none */
	__u16 pad2;
	__u64 addr[MT_MEMO_WORDS];
	__u64 val[MT_MEMO_WORDS];
	__u8 oi[MT_MEMO_WORDS]; /* word i is ips[oi[i]] (0: not a frame, a saved rbp; ips[0] is
				 * the key's, never a word's) */
	/* Refill plan (mt_memo_plan): a replay that finds word i outside its
	 * window reads rlen[i] bytes from addr[i] - rback[i] * 8, which hold
	 * the following words too (0: the walk's 2 KiB refill). */
	__u16 rlen[MT_MEMO_WORDS];
	__u8 rback[MT_MEMO_WORDS];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MT_MEMO_ENTRIES); /* the loader sizes it by CPU count */
	__type(key, __u32);
	__type(value, struct mt_memo_ent);
} unwind_memo SEC(".maps");
/* Set by the loader (UnwindMaps) to a new value whenever any process's
 * tables are published or removed: the memo is keyed by (tgid, epoch), so a
 * hit needs no unwind_procs lookup (a hash lookup, ~70 ns) and never replays
 * a walk made with other tables. 0: no tables yet. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} unwind_epoch SEC(".maps");

/* unwind_memo's max_entries - 1 (power of 2), set through skel->rodata. */
const volatile __u32 unwind_memo_mask = MT_MEMO_ENTRIES - 1;

/* Where a read for addr starts: a little below addr (never below floor, the
 * probe's rsp, which is mapped; at a word-aligned distance from addr): a
 * frame's saved rbp often sits below its return address (pushed after other
 * registers), and reading it second must not refill the window again. The
 * walk's windows, the first read of a stack and a memo entry's planned
 * refills all start here. */
static __always_inline __u64 mt_win_start(__u64 floor, __u64 addr)
{
	if (addr >= floor + MT_UNWIND_WIN_SLACK)
		return addr - MT_UNWIND_WIN_SLACK;
	if (addr > floor && !((addr - floor) & 7))
		return floor;
	return addr;
}

/* 16 bytes of user memory at addr into *dst (0, or -1: unreadable). A
 * global function: verified once, so its branches do not multiply the
 * unwind step's paths. */
MT_GLOBAL int mt_uread16(struct mt_unwind_win *w, __u64 addr,
					 struct mt_unwind_pair *dst)
{
	__u64 off, len, start;

	if (!w || !dst)
		return -1;
	off = addr - w->base;
	if (addr < w->base || off > w->len || w->len - off < 16 || (off & 7)) {
		if (addr & 7)
			return bpf_probe_read_user(dst, 16, (void *)addr) ? -1 : 0;
		start = mt_win_start(w->floor, addr);
		off = addr - start;
		len = MT_UNWIND_WIN_BYTES;
#ifdef MT_UNWIND_CACHE_STATS
		mt_unwind_count(MT_UC_COUNT + 3);
#endif
		if (w->top > start && w->top - start < MT_UNWIND_WIN_BYTES) {
			/* the main thread's stack ends within the window: read
			 * up to it, not into the unmapped page after it */
			len = w->top - start;
			if (len >= off + 16 &&
			    !bpf_probe_read_user(w->w, len & (MT_UNWIND_WIN_BYTES - 1), (void *)start)) {
				w->base = start;
				w->len = len;
				goto have;
			}
			w->len = 0;
			return bpf_probe_read_user(dst, 16, (void *)addr) ? -1 : 0;
		}
		if (bpf_probe_read_user(w->w, MT_UNWIND_WIN_BYTES, (void *)start)) {
			/* the window crosses the end of the mapping: up to the
			 * end of start's page */
			len = 4096 - (start & 4095);
			if (len < off + 16 || len >= MT_UNWIND_WIN_BYTES ||
			    bpf_probe_read_user(w->w, len & (MT_UNWIND_WIN_BYTES - 1), (void *)start)) {
				/* (the mask only tells the verifier len < the window) */
				w->len = 0;
				return bpf_probe_read_user(dst, 16, (void *)addr) ? -1 : 0;
			}
		}
		w->base = start;
		w->len = len;
	}
have:
	off = (off >> 3) & (MT_UNWIND_BUF_WORDS - 1);
	dst->a = w->w[off];
	dst->b = w->w[off + 1];
	return 0;
}

/* mt_uread16 with the common case inline: the 16 bytes are in the window.
 * Every call of a BPF function returns through the kernel's return thunk
 * (srso_alias_return_thunk on this AMD host: Safe RET), ~10 ns each; a
 * frame made one to three of them. */
static __always_inline int mt_uread16_fast(struct mt_unwind_win *w, __u64 addr,
					   struct mt_unwind_pair *dst)
{
	__u64 off = addr - w->base;

	if (addr >= w->base && off <= w->len && w->len - off >= 16 && !(off & 7)) {
		off = (off >> 3) & (MT_UNWIND_BUF_WORDS - 1);
		dst->a = w->w[off];
		dst->b = w->w[off + 1];
		return 0;
	}
	return mt_uread16(w, addr, dst);
}

#endif /* MT_UNWIND_STATE_BPF_H */
