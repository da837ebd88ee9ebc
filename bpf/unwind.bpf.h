/* CFI unwinding of user stacks (issue 5). Included by stack.bpf.h.
 *
 * User space (src/unwind) turns each executable file's .eh_frame/.debug_frame
 * into pc-sorted rows (struct mt_unwind_row, bpf/memtrace.h) in the shards
 * of unwind_shards, and records per process the executable mappings and which rows they use
 * (unwind_procs). Here, per frame: find the mapping of the pc (binary search
 * over the process's mappings), find the row (binary search over the file's
 * rows), compute the CFA, read the return address at CFA-8 and the caller's
 * rbp where the row says it was saved. No row for a pc: frame-pointer step.
 * Frames are walked by bpf_loop, so the verifier sees one step.
 *
 * Loader side: skel->maps.unwind_shards (BPF_F_MMAPABLE arrays, written
 * through mmap), skel->maps.unwind_procs; see src/unwind/unwind_maps.h.
 */
#ifndef MT_UNWIND_BPF_H
#define MT_UNWIND_BPF_H

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
__attribute__((noinline)) int mt_uread16(struct mt_unwind_win *w, __u64 addr,
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

/* Set through skel->rodata before load: 1 = frame pointers only. */
const volatile __u32 unwind_disabled = 0;

/* Binary-search bounds: log2 of the most rows of one file / mappings. */
#define MT_UNWIND_ROW_STEPS (MT_UNWIND_ROW_BITS + 1)
#define MT_UNWIND_MAP_STEPS 9 /* > log2(MT_UNWIND_MAX_MAPPINGS) */


struct mt_unwind_ctx {
	__u64 pc;  /* current frame's pc */
	__u64 sp;  /* its rsp */
	__u64 bp;  /* its rbp */
	struct mt_stack *out;
	struct mt_unwind_proc *proc;
	struct mt_unwind_win *win;
	struct mt_unwind_rc *rc;
	__u32 n;        /* frames in out->ips */
	__u32 reason;   /* enum mt_unwind_counter that ended the walk (0: running) */
	__u32 exact_pc; /* pc is not a return address (frame 0 at a non-entry probe) */
	__u32 bp_lost;  /* rbp of this frame is not known */
	__u32 gen;      /* proc->gen */
	__u32 frames_fp;/* of n: recovered by the frame-pointer fallback */
	__u64 h;        /* mt_stack_hash of ips[0..n), folded in as frames are found */
	struct mt_memo_ent *me; /* memo entry this walk records into */
};

/* Memo: the walk used the stack word val at addr. is_ra: it is the return
 * address the step will append (if it does: see mt_memo_frame). */
static __always_inline void mt_memo_rec(struct mt_unwind_ctx *c, __u64 addr, __u64 val,
					__u32 is_ra)
{
	struct mt_memo_ent *e = c->me;
	__u32 k;

	/* The word count lives in the entry, not in c: loaded from map
	 * memory it is an unknown number to the verifier, which otherwise
	 * verified the step once per count (it indexes memory, so the
	 * verifier tracks it exactly) and ran out of its 1M instructions. */
	if (!e)
		return;
	k = e->nw;
	if (k < MT_MEMO_WORDS) {
		e->addr[k] = addr;
		e->val[k] = val;
		e->oi[k] = 0;
	}
	if (is_ra)
		e->ra_k = k;
	e->nw = k + 1;
}

/* Memo: the step appended its return address (word c->ra_k) as frame
 * c->n - 1. */
static __always_inline void mt_memo_frame(struct mt_unwind_ctx *c)
{
	struct mt_memo_ent *e = c->me;
	__u32 k;

	if (!e)
		return;
	k = e->ra_k;
	if (k < MT_MEMO_WORDS)
		e->oi[k] = c->n - 1;
}

/* Memo: the walk is about to use c->bp. A saved rbp only counts as an
 * input of the walk when it is used: in code without frame pointers rbp is
 * an ordinary register, and the values frames saved (object pointers,
 * counters) would otherwise make every stack look new. */
static __always_inline void mt_memo_use_bp(struct mt_unwind_ctx *c)
{
	struct mt_memo_ent *e = c->me;

	if (!e)
		return;
	if (!e->bp_mem) {
		e->bp0_used = 1;
	} else if (!e->bp_rec) {
		mt_memo_rec(c, e->bp_addr, c->bp, 0);
		e->bp_rec = 1;
	}
}

/* The caller's rbp was read from the stack at addr (recorded if used). */
static __always_inline void mt_memo_bp_read(struct mt_unwind_ctx *c, __u64 addr)
{
	struct mt_memo_ent *e = c->me;

	if (!e)
		return;
	e->bp_mem = 1;
	e->bp_rec = 0;
	e->bp_addr = addr;
}

/* Binary searches run under bpf_loop too: as plain bounded loops the
 * verifier would walk every path of every iteration (2^steps). */
struct mt_bsearch {
	__u32 lo, hi; /* answer: lo - 1 = last entry with key <= x */
	__u64 x;
	struct mt_unwind_proc *proc;
};

/* Row idx (global); null if its shard is not there. */
static __always_inline struct mt_unwind_row *mt_row(__u32 idx)
{
	__u32 shard = idx >> MT_UNWIND_SHARD_BITS, i = idx & MT_UNWIND_SHARD_MASK;
	void *rows = bpf_map_lookup_elem(&unwind_shards, &shard);

	if (!rows)
		return 0;
	return bpf_map_lookup_elem(rows, &i);
}

static long mt_bsearch_map_step(__u64 i, void *arg)
{
	struct mt_bsearch *b = arg;
	__u32 mid;

	if (b->lo >= b->hi || !b->proc)
		return 1;
	mid = b->lo + (b->hi - b->lo) / 2;
	if (b->proc->m[mid & (MT_UNWIND_MAX_MAPPINGS - 1)].start <= b->x)
		b->lo = mid + 1;
	else
		b->hi = mid;
	return 0;
}

static long mt_bsearch_row_step(__u64 i, void *arg)
{
	struct mt_bsearch *b = arg;
	struct mt_unwind_row *r;
	__u32 mid;

	if (b->lo >= b->hi)
		return 1;
	mid = b->lo + (b->hi - b->lo) / 2;
	r = mt_row(mid);
	if (!r) {
		b->lo = 0;
		b->hi = 0;
		return 1;
	}
	if (r->pc <= b->x)
		b->lo = mid + 1;
	else
		b->hi = mid;
	return 0;
}

/* Row for pc in mapping m (which covers pc): fills *row, returns 0; -2 if
 * none. b: the caller's search state (one for both searches: the whole
 * call chain of a probe has 512 bytes of stack on 6.1, and uses ~500). */
static __always_inline int mt_unwind_rows_find(const struct mt_unwind_mapping *m, __u64 pc,
					       struct mt_unwind_row *row, struct mt_bsearch *b)
{
	struct mt_unwind_row *r;
	__u32 first;
	__u64 rel;

	if (m->nr_rows == 0 || pc < m->bias)
		return -2;
	rel = pc - m->bias;
	if (rel > 0xffffffffULL)
		return -2;
	first = m->first_row;
	b->lo = first;
	b->hi = first + m->nr_rows;
	b->x = rel;
	b->proc = 0;
	bpf_loop(MT_UNWIND_ROW_STEPS, mt_bsearch_row_step, b, 0);
	if (b->lo <= first)
		return -2;
	r = mt_row(b->lo - 1);
	if (!r)
		return -2;
	*row = *r;
	return 0;
}

/* The mapping of proc that covers pc and has rows; null if none. */
static __always_inline struct mt_unwind_mapping *mt_unwind_find_mapping(struct mt_unwind_proc *proc,
									 __u64 pc, struct mt_bsearch *b)
{
	struct mt_unwind_mapping *m;

	b->lo = 0;
	b->hi = proc->nr;
	if (b->hi > MT_UNWIND_MAX_MAPPINGS)
		b->hi = MT_UNWIND_MAX_MAPPINGS;
	b->x = pc;
	b->proc = proc;
	bpf_loop(MT_UNWIND_MAP_STEPS, mt_bsearch_map_step, b, 0);
	if (b->lo == 0)
		return 0;
	m = &proc->m[(b->lo - 1) & (MT_UNWIND_MAX_MAPPINGS - 1)];
	/* A mapping without rows may be stale too: ld.so's reservation of a
	 * library's extent, which the library's code mappings replaced since */
	if (pc >= m->end || m->nr_rows == 0)
		return 0;
	return m;
}

/* The pc's VMA -> its file in unwind_files -> the mapping it would have,
 * in a per-CPU scratch value (the callback's context stays off the stack:
 * 6.1 allows the whole call chain 512 bytes of stack). */
struct mt_vma_rows {
	struct mt_unwind_mapping m;
	__u64 found;
	struct mt_unwind_file_key key; /* the callback's lookup key */
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_vma_rows);
} unwind_vma_scratch SEC(".maps");

static long mt_unwind_vma_cb(struct task_struct *task, struct vm_area_struct *vma, void *data)
{
	struct mt_unwind_file *f;
	struct mt_vma_rows *a;
	/* direct (BTF) loads: BPF_CORE_READ's copies would take stack */
	struct file *file = vma->vm_file;
	__u32 zero = 0;
	__u64 off, start;

	if (!file)
		return 0;
	a = bpf_map_lookup_elem(&unwind_vma_scratch, &zero);
	if (!a)
		return 0;
	a->key.ino = file->f_inode->i_ino;
	a->key.dev = file->f_inode->i_sb->s_dev;
	f = bpf_map_lookup_elem(&unwind_files, &a->key);
	if (!f)
		return 0;
	start = vma->vm_start;
	off = vma->vm_pgoff << 12;
	for (int i = 0; i < MT_UNWIND_FILE_SEGS; i++) {
		if (i >= f->nseg)
			break;
		if (off >= f->seg[i].off_lo && off < f->seg[i].off_hi) {
			/* the loader's load bias (UnwindMaps::add_mapping) */
			a->m.start = start;
			a->m.end = vma->vm_end;
			a->m.bias = start - off - f->seg[i].delta + f->base;
			a->m.first_row = f->first_row;
			a->m.nr_rows = f->nr_rows;
			a->found = 1;
			break;
		}
	}
	return 0;
}

/* The mapping of pc made from the current task's VMA of it, for a pc no
 * published mapping covers; null if its file's rows are not loaded. */
static __always_inline struct mt_unwind_mapping *mt_unwind_vma_mapping(__u64 pc)
{
	struct mt_vma_rows *a;
	__u32 zero = 0;

	a = bpf_map_lookup_elem(&unwind_vma_scratch, &zero);
	if (!a)
		return 0;
	a->found = 0;
	if (bpf_find_vma(bpf_get_current_task_btf(), pc, mt_unwind_vma_cb, 0, 0) || !a->found)
		return 0;
	if (pc < a->m.start || pc >= a->m.end)
		return 0;
	return &a->m;
}

/* The L2 row cache's slot of (lookup pc, gen). */
static __always_inline __u32 mt_row_cache_slot(__u64 lookup, __u32 gen)
{
	return (__u32)(((lookup ^ ((__u64)gen << 32)) * 0xC2B2AE3D27D4EB4FULL) >> 40) &
	       (MT_UNWIND_CACHE_ENTRIES - 1);
}

/* Keeps row r of (lookup, gen) in L2 entry ce (if any), copies it out:
 * 0, or -1 for no row. */
static __always_inline int mt_row_cache_put(struct mt_unwind_cache_ent *ce, __u64 lookup, __u32 gen,
					    const struct mt_unwind_row *r, struct mt_unwind_row *row)
{
	if (ce) {
		ce->pc = lookup;
		ce->gen = gen;
		ce->row = *r;
	}
	*row = *r;
	return MT_ROW_CFA(r) == MT_CFA_NONE ? -1 : 0;
}

/* L1 (unwind_rc) miss: the L2 cache, else the binary searches. A global
 * function: verified once, not once per path of the frame step that calls
 * it; the call (~10 ns) is paid on ~1% of frames. Fills *row, returns 0;
 * -1: no row; 1: no published mapping with rows covers lookup (the caller
 * asks mt_unwind_vma_miss; nothing cached). */
__attribute__((noinline)) int mt_unwind_row_miss(struct mt_unwind_proc *proc, __u64 lookup,
						  __u32 gen, struct mt_unwind_row *row)
{
	__u32 slot = mt_row_cache_slot(lookup, gen);
	struct mt_unwind_cache_ent *ce;
	struct mt_unwind_mapping *m;
	struct mt_bsearch b = {};
	struct mt_unwind_row r = {};

	if (!proc || !row)
		return -1;
	ce = bpf_map_lookup_elem(&unwind_row_cache, &slot);
	if (ce && ce->pc == lookup && ce->gen == gen) {
		*row = ce->row;
		return MT_ROW_CFA(&ce->row) == MT_CFA_NONE ? -1 : 0;
	}
	m = mt_unwind_find_mapping(proc, lookup, &b);
	if (!m)
		return 1;
	if (mt_unwind_rows_find(m, lookup, &r, &b))
		r.kind = MT_CFA_NONE;
	return mt_row_cache_put(ce, lookup, gen, &r, row);
}

/* mt_unwind_row_miss found no published mapping of lookup: the mapping its
 * VMA gives, the row there, into the L2 cache. A global function of its
 * own, called from the step: a probe's whole call chain has 512 bytes of
 * stack on 6.1 (~500 used), so this is not one call deeper. */
__attribute__((noinline)) int mt_unwind_vma_miss(__u64 lookup, __u32 gen, struct mt_unwind_row *row)
{
	__u32 slot = mt_row_cache_slot(lookup, gen);
	struct mt_unwind_cache_ent *ce;
	struct mt_unwind_mapping *m;
	struct mt_bsearch b = {};
	struct mt_unwind_row r = {};

	if (!row)
		return -1;
	m = mt_unwind_vma_mapping(lookup);
	if (!m || mt_unwind_rows_find(m, lookup, &r, &b))
		r.kind = MT_CFA_NONE;
	else
		mt_unwind_count(MT_UC_ROWS_VMA);
	ce = bpf_map_lookup_elem(&unwind_row_cache, &slot);
	return mt_row_cache_put(ce, lookup, gen, &r, row);
}

#ifdef __TARGET_ARCH_arm64
/* The row of lookup: the L1 cache (unwind_rc), else mt_unwind_row_miss
 * (L2, binary searches) and the pc's VMA; kept in L1. No row: MT_CFA_NONE.
 * (The x86-64 step has this inline: through this function clang lays out
 * its hot path differently, 5 instructions more.) */
static __always_inline void mt_unwind_row_of(struct mt_unwind_ctx *c, __u64 lookup,
					     struct mt_unwind_row *row)
{
	__u32 slot = (__u32)(((lookup ^ ((__u64)c->gen << 32)) * 0x9E3779B97F4A7C15ULL) >> 40) &
		     (MT_UNWIND_RC_ENTRIES - 1);
	struct mt_unwind_cache_ent *ce = &c->rc->e[slot];
	if (ce->pc == lookup && ce->gen == c->gen) {
		*row = ce->row;
#ifdef MT_UNWIND_CACHE_STATS
		mt_unwind_count(MT_UC_COUNT + 1);
#endif
	} else {
#ifdef MT_UNWIND_CACHE_STATS
		mt_unwind_count(MT_UC_COUNT + 2);
#endif
		int rm = mt_unwind_row_miss(c->proc, lookup, c->gen, row);
		if (rm == 1)
			rm = mt_unwind_vma_miss(lookup, c->gen, row);
		if (rm != 0)
			row->kind = MT_CFA_NONE;
		ce->pc = lookup;
		ce->gen = c->gen;
		ce->row = *row;
	}
}
#endif

/* The step found the caller: ra its return address (0: the stack ends),
 * cfa its sp, bp its rbp/x29. Appends ra; 0, or 1 to end the walk. */
static __always_inline long mt_unwind_push(struct mt_unwind_ctx *c, __u64 ra, __u64 cfa, __u64 bp,
					   int from_fp)
{
	if (ra == 0) {
		c->reason = MT_UC_END_ZERO;
		return 1;
	}
	if (c->n >= MT_MAX_FRAMES) {
		c->reason = MT_UC_TRUNC_DEPTH;
		return 1;
	}
	c->out->ips[c->n & (MT_MAX_FRAMES - 1)] = ra;
	c->n++;
	mt_memo_frame(c);
	c->h = mt_hash_step(c->h, ra);
	c->frames_fp += from_fp;
	c->pc = ra;
	c->sp = cfa;
	c->bp = bp;
	c->exact_pc = 0;
	return 0;
}

/* One frame: from (pc, sp, bp) to the caller's; appends the return address. */
static __always_inline long mt_unwind_step(struct mt_unwind_ctx *c)
{
	struct mt_unwind_row row = {};
	__u64 cfa, ra = 0, bp = c->bp, lookup;
	__u32 type, rule;
	int from_fp = 0;

	if (!c->proc || !c->out)
		return 1;
	lookup = c->exact_pc ? c->pc : c->pc - 1; /* return address: the call is before it */
	if (!c->win || !c->rc)
		return 1;
	{
		__u32 slot = (__u32)(((lookup ^ ((__u64)c->gen << 32)) * 0x9E3779B97F4A7C15ULL) >> 40) &
			     (MT_UNWIND_RC_ENTRIES - 1);
		struct mt_unwind_cache_ent *ce = &c->rc->e[slot];
		if (ce->pc == lookup && ce->gen == c->gen) {
			row = ce->row;
#ifdef MT_UNWIND_CACHE_STATS
			mt_unwind_count(MT_UC_COUNT + 1);
#endif
		} else {
#ifdef MT_UNWIND_CACHE_STATS
			mt_unwind_count(MT_UC_COUNT + 2);
#endif
			int rm = mt_unwind_row_miss(c->proc, lookup, c->gen, &row);
			if (rm == 1)
				rm = mt_unwind_vma_miss(lookup, c->gen, &row);
			if (rm != 0)
				row.kind = MT_CFA_NONE;
			ce->pc = lookup;
			ce->gen = c->gen;
			ce->row = row;
		}
	}
	type = MT_ROW_CFA(&row);
	rule = MT_ROW_RBP(&row);

	switch (type) {
	case MT_CFA_RSP:
		cfa = c->sp + (__s64)row.cfa_off * 8;
		break;
	case MT_CFA_RBP:
		if (c->bp_lost) {
			c->reason = MT_UC_TRUNC_UNSUPPORTED;
			return 1;
		}
		mt_memo_use_bp(c);
		cfa = c->bp + (__s64)row.cfa_off * 8;
		break;
	case MT_CFA_RBP_DEREF:
		{
			struct mt_unwind_pair p;
			__u64 at = c->bp + (__s64)row.cfa_off * 8;
			if (c->bp_lost || mt_uread16_fast(c->win, at, &p)) {
				c->reason = c->bp_lost ? MT_UC_TRUNC_UNSUPPORTED : MT_UC_TRUNC_READ;
				return 1;
			}
			mt_memo_use_bp(c);
			mt_memo_rec(c, at, p.a, 0);
			cfa = p.a;
		}
		break;
	case MT_CFA_PLT:
		cfa = c->sp + 8 + ((c->pc & 15) >= (__u64)row.cfa_off ? 8 : 0);
		break;
	case MT_CFA_END:
		c->reason = MT_UC_END_OUTERMOST;
		return 1;
	case MT_CFA_NONE: {
		/* No CFI here: frame-pointer step. */
		struct mt_unwind_pair p;
		if (c->bp_lost) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_use_bp(c);
		if (c->bp == 0) {
			c->reason = MT_UC_END_ZERO;
			return 1;
		}
		if ((c->bp & 7) || c->bp < c->sp || mt_uread16_fast(c->win, c->bp, &p)) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_rec(c, c->bp + 8, p.b, 1);
		mt_memo_bp_read(c, c->bp);
		bp = p.a;
		ra = p.b;
		cfa = c->bp + 16;
		from_fp = 1;
		break;
	}
	default:
		c->reason = MT_UC_TRUNC_UNSUPPORTED;
		return 1;
	}
	if (cfa <= c->sp) {
		c->reason = MT_UC_TRUNC_BAD_FRAME;
		return 1;
	}
	if (!from_fp && rule == MT_RBP_AT_CFA && row.rbp_off == -2) {
		/* push %rbp right after the call: saved rbp and return address
		 * are adjacent, one read. */
		struct mt_unwind_pair p;
		if (mt_uread16_fast(c->win, cfa - 16, &p)) {
			c->reason = MT_UC_TRUNC_READ;
			return 1;
		}
		mt_memo_rec(c, cfa - 8, p.b, 1);
		mt_memo_bp_read(c, cfa - 16);
		bp = p.a;
		ra = p.b;
		c->bp_lost = 0;
	} else if (!from_fp) {
		struct mt_unwind_pair p;
		if (mt_uread16_fast(c->win, cfa - 8, &p)) {
			c->reason = MT_UC_TRUNC_READ;
			return 1;
		}
		mt_memo_rec(c, cfa - 8, p.a, 1);
		ra = p.a;
		if (rule == MT_RBP_AT_CFA || rule == MT_RBP_AT_RBP) {
			__u64 at = rule == MT_RBP_AT_CFA ? cfa : c->bp;
			if (rule == MT_RBP_AT_RBP && c->bp_lost) {
				c->bp_lost = 1;
			} else {
				if (rule == MT_RBP_AT_RBP)
					mt_memo_use_bp(c);
				at += (__s64)row.rbp_off * 8;
				if (mt_uread16_fast(c->win, at, &p)) {
					c->reason = MT_UC_TRUNC_READ;
					return 1;
				}
				mt_memo_bp_read(c, at);
				bp = p.a;
				c->bp_lost = 0;
			}
		} else if (rule == MT_RBP_UNKNOWN) {
			c->bp_lost = 1;
		}
	}
	return mt_unwind_push(c, ra, cfa, bp, from_fp);
}

#ifdef __TARGET_ARCH_arm64
/* One arm64 frame (issue 20): the row read as bpf/memtrace.h's arm64 rows
 * say. The CFA is the caller's sp, on sp or x29; the return address is
 * x30: in its register (the first frame only: an exact pc in a leaf, a
 * .plt stub, a function's entry), or saved in the frame, usually next to
 * x29 (stp x29, x30), the slot k words from the CFA (a row keeps it from
 * the CFA or from the CFA's register: memtrace.h). No row: the frame record ([x29] = the caller's x29,
 * [x29+8] = x30), which does not tell the caller's sp: c->bp_lost bit 1
 * (bit 0: x29 lost) until a row gives it back. Return addresses lose
 * their PAC bits (MT_ARM64_VA_MASK). */
static __always_inline long mt_unwind_step_arm64(struct mt_unwind_ctx *c)
{
	struct mt_unwind_row row = {};
	struct mt_unwind_pair p = {};
	__u64 cfa, ra = 0, bp = c->bp, lookup, slot;
	__u32 type, rule, ra_rule, x29_saved;
	__s64 k; /* the save slot, in words from the CFA */
	int from_fp = 0;

	if (!c->proc || !c->out || !c->win || !c->rc)
		return 1;
	lookup = c->exact_pc ? c->pc : c->pc - 1; /* return address: the bl is before it */
	mt_unwind_row_of(c, lookup, &row);
	type = MT_ROW_CFA(&row);
	rule = MT_ROW_X29_ARM64(&row);
	ra_rule = MT_ROW_RA_ARM64(&row);
	x29_saved = rule == MT_RBP_AT_CFA || rule == MT_X29_AT_BASE_ARM64;
	k = row.rbp_off;
	if (rule == MT_X29_AT_BASE_ARM64 || ra_rule == MT_RA_AT_BASE)
		k -= row.cfa_off; /* kept from sp or x29, the CFA's register */

	switch (type) {
	case MT_CFA_RSP:
		if (c->bp_lost & 2) {
			/* sp unknown past a frame record; a function that saved
			 * x29 at CFA + k and keeps a frame record has x29 =
			 * CFA + k (stp x29, x30, [sp, #-N]!; mov x29, sp) */
			if ((c->bp_lost & 1) || !x29_saved) {
				c->reason = MT_UC_TRUNC_UNSUPPORTED;
				return 1;
			}
			mt_memo_use_bp(c);
			cfa = c->bp - k * 8;
		} else {
			cfa = c->sp + (__s64)row.cfa_off * 8;
		}
		break;
	case MT_CFA_RBP:
		if (c->bp_lost & 1) {
			c->reason = MT_UC_TRUNC_UNSUPPORTED;
			return 1;
		}
		mt_memo_use_bp(c);
		cfa = c->bp + (__s64)row.cfa_off * 8;
		break;
	case MT_CFA_END:
		c->reason = MT_UC_END_OUTERMOST;
		return 1;
	case MT_CFA_NONE:
		/* No CFI here: the frame record at x29. */
		if (c->bp_lost & 1) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_use_bp(c);
		if (c->bp == 0) {
			c->reason = MT_UC_END_ZERO;
			return 1;
		}
		if ((c->bp & 7) || c->bp < c->sp || mt_uread16_fast(c->win, c->bp, &p)) {
			c->reason = MT_UC_TRUNC_NO_TABLE;
			return 1;
		}
		mt_memo_rec(c, c->bp + 8, p.b, 1);
		mt_memo_bp_read(c, c->bp);
		bp = p.a;
		ra = p.b;
		cfa = c->bp + 16; /* at least: the caller's sp is unknown */
		from_fp = 1;
		break;
	default:
		c->reason = MT_UC_TRUNC_UNSUPPORTED;
		return 1;
	}
	/* (at an entry or in a leaf nothing was pushed: CFA = sp) */
	if (cfa < c->sp || (cfa == c->sp && ra_rule != MT_RA_REG)) {
		c->reason = MT_UC_TRUNC_BAD_FRAME;
		return 1;
	}
	if (from_fp) {
		c->bp_lost |= 2;
	} else {
		slot = cfa + k * 8;
		if (ra_rule != MT_RA_REG || x29_saved) {
			if (mt_uread16_fast(c->win, slot, &p)) {
				c->reason = MT_UC_TRUNC_READ;
				return 1;
			}
		}
		if (ra_rule == MT_RA_PAIR) {
			mt_memo_rec(c, slot + 8, p.b, 1);
			ra = p.b;
		} else if (ra_rule == MT_RA_AT_CFA || ra_rule == MT_RA_AT_BASE) {
			mt_memo_rec(c, slot, p.a, 1);
			ra = p.a;
		} else if (c->exact_pc && c->win->io.lr) {
			/* x30 itself: known at the probe only. The memo is not
			 * keyed by it: this walk is not kept (nw past the limit). */
			ra = c->win->io.lr;
			if (c->me)
				c->me->nw = MT_MEMO_WORDS + 1;
		} else {
			c->reason = MT_UC_TRUNC_UNSUPPORTED;
			return 1;
		}
		if (x29_saved) {
			mt_memo_bp_read(c, slot);
			bp = p.a;
			c->bp_lost = 0;
		} else if (rule == MT_RBP_UNKNOWN) {
			c->bp_lost = 1;
		} else {
			c->bp_lost &= 1;
		}
	}
	return mt_unwind_push(c, ra & MT_ARM64_VA_MASK, cfa, bp, from_fp);
}
#endif

/* bpf_loop callback: one frame. (Two or four inlined frames per call save
 * a call and a thunked return each, ~3% of W1's probe time, but double or
 * quadruple the verifier's work: 170k -> 300k / 670k instructions.) */
static long mt_unwind_step_cb(__u64 i, void *arg)
{
#ifdef __TARGET_ARCH_arm64
	return mt_unwind_step_arm64(arg);
#else
	return mt_unwind_step(arg);
#endif
}

/* CFI walk. Returns -1 when the process has no tables (caller falls back to
 * its frame-pointer walk), else the capture flags. */
/* User registers at the probe, as plain values. */
struct mt_uregs {
	__u64 ip, sp, bp;
	__u32 tgid; /* of the current task */
	__u32 pad;
	__u64 start_stack; /* current->mm->start_stack (0: unknown), read by
			    * the caller from the task it has (no helper call) */
#ifdef __TARGET_ARCH_arm64
	__u64 lr; /* x30: the return address at a function's entry */
#endif
};

/* A planned refill: len bytes of user memory at start into the window
 * (0; -1: unreadable, the window is empty). A global function: one copy of
 * its checks for every word of the replay loop. */
__attribute__((noinline)) int mt_urefill(struct mt_unwind_win *w, __u64 start, __u32 len)
{
	len &= MT_UNWIND_BUF_BYTES - 1; /* (plans stay below it) */
	if (!w || len == 0)
		return -1;
#ifdef MT_UNWIND_CACHE_STATS
	mt_unwind_count(MT_UC_COUNT + 3);
#endif
	if (bpf_probe_read_user(w->w, len, (void *)start)) {
		w->len = 0;
		return -1;
	}
	w->base = start;
	w->len = len;
	return 0;
}

/* Refill plan of a memo entry, made once when the walk is recorded: how
 * much the first read needs, which words a replay will find outside its
 * window after it, and how much to read there. The first read starts at
 * b (mt_win_start of the entry probe's return address, the same for every
 * stack taken at this rsp) and covers the return address the memo key needs
 * (key_end bytes) and then the first cluster of recorded words: a stack's
 * return addresses come in clusters (python3's eval frames ~300 bytes apart,
 * sqlite3's at 0-3, 5, 9-11 and 15-17 KiB), and each later refill reads from
 * its word up to the last of the following words that lie within
 * MT_MEMO_PLAN_GAP of each other. (The walk itself read fixed 2 KiB windows.)
 * floor: rsp at the probe (the stack is readable from there up).
 * A copy costs ~75 ns whatever its size (bench/unwind/copy_cost: a
 * bpf_probe_read_user of 8 bytes) and ~6 ns per KiB of hot stack, so words
 * up to 8 KiB apart are read with one copy (sqlite3: 3 copies per stack
 * -> 2, W3 ns/call 0.91x against a 4 KiB gap; W1 the same; docs/unwind-perf.md
 * round 6). Reads stay below MT_UNWIND_BUF_BYTES. */
#ifndef MT_MEMO_PLAN_GAP
#define MT_MEMO_PLAN_GAP 8192
#endif
#define MT_PLAN_NONE MT_MEMO_WORDS       /* plan_cur: no refill to extend */
#define MT_PLAN_FIRST (MT_MEMO_WORDS + 1) /* plan_cur: extend the first read */
__attribute__((noinline)) int mt_memo_plan(struct mt_memo_ent *e, __u64 b, __u32 key_end,
					   __u64 floor)
{
	__u64 l = key_end;
	__u32 nw;

	if (!e)
		return 0;
	nw = e->nw;
	e->first_len = key_end;
	/* The refill being extended lives in the entry: a counter that
	 * indexes memory, kept in a register, is tracked exactly by the
	 * verifier (every value of it, in every iteration). */
	e->plan_cur = key_end ? MT_PLAN_FIRST : MT_PLAN_NONE;
	for (int i = 0; i < MT_MEMO_WORDS; i++) {
		__u64 a, s;
		__u32 cur;

		if (i >= nw)
			break;
		a = e->addr[i];
		e->rlen[i] = 0;
		e->rback[i] = 0;
		if (a >= b && a - b <= l && l - (a - b) >= 16)
			continue; /* in the window */
		cur = *(volatile __u32 *)&e->plan_cur; /* (not the value clang knows) */
		if (cur != MT_PLAN_NONE && a >= b && a + 16 - b < MT_UNWIND_BUF_BYTES &&
		    a - b < l + MT_MEMO_PLAN_GAP) {
			l = a + 16 - b; /* the planned read reaches up to here */
			if (cur < MT_MEMO_WORDS)
				e->rlen[cur] = l;
			else
				e->first_len = l;
			continue;
		}
		s = mt_win_start(floor, a);
		b = s;
		l = a + 16 - s;
		e->plan_cur = i;
		e->rlen[i] = l;
		e->rback[i] = (a - s) >> 3;
	}
	return 0;
}

/* The first read of an entry probe's stack: len bytes from the window start
 * for addr (the probed function's return address), as the hint for this
 * rsp says; 0: done (the window holds addr), -1: not done (no hint, or the
 * read failed: the caller reads the usual 2 KiB window). */
__attribute__((noinline)) int mt_first_read(struct mt_unwind_win *w, __u64 addr, __u32 len)
{
	__u64 start;

	if (!w || len == 0)
		return -1;
	start = mt_win_start(w->floor, addr);
	if (w->top > start && w->top - start < len)
		len = w->top - start; /* the main thread's stack ends there */
	if (addr - start + 16 > len)
		return -1;
	return mt_urefill(w, start, len);
}

/* Memo hit check: e was recorded from the same registers and rows; re-read
 * its words and rebuild out->ips from them. 0: out holds the stack; -1: a
 * word differs (or cannot be read): walk. A global function: verified once,
 * so that each way its loop can end does not make the verifier check the
 * walk after it again. */
__attribute__((noinline)) int mt_memo_replay(struct mt_unwind_win *w, struct mt_memo_ent *e,
					     __u64 ip, struct mt_stack *out)
{
	__u32 nw;

	if (!w || !e || !out || e->nr == 0 || e->nr > MT_MAX_FRAMES)
		return -1;
	nw = e->nw;
	out->ips[0] = ip; /* the first frame is part of the key */
	/* (No frame counter: the verifier would tell its values apart in
	 * every iteration. Each word knows its frame index.) */
	for (int i = 0; i < MT_MEMO_WORDS; i++) {
		struct mt_unwind_pair p;
		__u64 a, off;
		__u32 k;

		if (i >= nw)
			break;
		a = e->addr[i];
		off = a - w->base;
		if (a < w->base || off > w->len || w->len - off < 16) {
			__u32 rl = e->rlen[i];
			/* (a failed planned read leaves the window empty: the
			 * next read takes the walk's way) */
			if (rl)
				mt_urefill(w, a - ((__u64)e->rback[i] << 3), rl);
		}
		if (mt_uread16_fast(w, a, &p) || p.a != e->val[i])
			return -1;
		k = e->oi[i] & (MT_MAX_FRAMES - 1); /* (frame indexes are below it) */
		if (k)
			out->ips[k] = p.a;
	}
	out->nr = e->nr;
	out->stack_id = e->stack_id;
	return 0;
}

/* Counters and flags of a finished stack (walked or replayed). */
static __always_inline int mt_unwind_done(__u32 n, __u32 frames_fp, __u32 reason)
{
	mt_unwind_count(MT_UC_STACKS);
	mt_unwind_count(reason);
	/* frames past the first (ips[0] is read, not unwound) */
	if (n > 1) {
		__u32 unwound = n - 1;
		if (unwound > frames_fp)
			mt_unwind_add(MT_UC_FRAMES_CFI, unwound - frames_fp);
		if (frames_fp)
			mt_unwind_add(MT_UC_FRAMES_FP, frames_fp);
	}
	return reason >= MT_UC_TRUNC_DEPTH ? MT_F_STACK_TRUNCATED : 0;
}


/* The frame loop. A global function: the verifier checks it once, whatever
 * state its caller is in (inlined, every branch before it -- memo hit or
 * not, entry probe or not -- multiplied its work past the 1M limit). */
__attribute__((noinline)) int mt_unwind_walk(struct mt_walk_io *io, struct mt_stack *out,
					     struct mt_unwind_win *win, struct mt_unwind_proc *proc,
					     struct mt_memo_ent *me)
{
	struct mt_unwind_ctx c = {};
	__u32 zero = 0;

	if (!io || !out || !win || !proc || !me)
		return -1;
	c.rc = bpf_map_lookup_elem(&unwind_rc, &zero);
	if (!c.rc)
		return -1;
	c.out = out;
	c.win = win;
	c.proc = proc;
	c.me = me;
	c.pc = io->pc;
	c.sp = io->sp;
	c.bp = io->bp;
	c.h = io->h;
	c.gen = io->gen;
	c.exact_pc = io->exact_pc;
	c.n = io->n;
	bpf_loop(MT_MAX_FRAMES, mt_unwind_step_cb, &c, 0);
	io->sp = c.sp;
	io->h = c.h;
	io->n = c.n;
	io->reason = c.reason ? c.reason : MT_UC_TRUNC_DEPTH;
	io->frames_fp = c.frames_fp;
	return 0;
}


#define MT_MEMO_WAYS 4 /* power of 2, <= the smallest memo the loader makes (16) */

/* The memo set at k->slot: replays the first way recorded for these
 * registers whose words are unchanged. 0: a hit, out holds the stack; -1: a
 * miss, k->slot is the way to record the walk into (empty, or the least
 * recently used). Four ways: one call site at one depth is often reached
 * from several places further up (sqlite3: 35% of its stacks missed with
 * one way, 20% with two, all of them with the key of a recorded way). A
 * global function: verified once, whatever its caller did before. */
__attribute__((noinline)) int mt_memo_lookup(struct mt_unwind_win *win, struct mt_memo_key *k,
					     struct mt_stack *out)
{
	__u64 oldest = ~0ULL;
	__u32 first, victim;

	if (!win || !k || !out)
		return -1;
	first = k->slot;
	victim = first;
	for (int w = 0; w < MT_MEMO_WAYS; w++) {
		__u32 slot = first + w;
		struct mt_memo_ent *e = bpf_map_lookup_elem(&unwind_memo, &slot);

		if (!e) /* (never: slot is masked by the map's size) */
			return -1;
		if (e->gen == k->epoch && e->tgid == k->tgid && e->sp == k->sp && e->ip == k->pc &&
		    e->ret_at == k->ret_at && (!(e->flags & MT_MEMO_F_BP) || e->bp == k->bp)) {
			__u32 fl = e->first_len;
			/* The first cluster is read as one (the hint was short,
			 * or another way's replay moved the window). */
			if (fl && win->len0 && !(win->base == win->base0 && win->len >= fl))
				mt_urefill(win, win->base0, fl);
			if (mt_memo_replay(win, e, k->pc, out) == 0) {
				e->used = win->clock;
				k->nr = e->nr;
				k->frames_fp = e->frames_fp;
				k->reason = e->reason;
				k->first_len = fl;
				return 0;
			}
#ifdef MT_UNWIND_CACHE_STATS
			mt_unwind_count(MT_UC_COUNT + 8);
#endif
		}
		if (e->used < oldest) {
			oldest = e->used;
			victim = slot;
		}
	}
	k->slot = victim;
	return -1;
}

/* The empty value a process without a published one walks with, under its
 * own gen (see unwind_lazy_gen). */
static __always_inline struct mt_unwind_proc *mt_unwind_noproc(__u32 tgid)
{
	struct mt_unwind_noproc *p;
	__u32 zero = 0, *g, gen;

	p = bpf_map_lookup_elem(&unwind_noproc, &zero);
	if (!p)
		return 0;
	g = bpf_map_lookup_elem(&unwind_lazy_gen, &tgid);
	if (g) {
		gen = *g;
	} else {
		p->next++;
		gen = 0x80000000u | (bpf_get_smp_processor_id() & 127) << 24 | (p->next & 0xffffff);
		if (bpf_map_update_elem(&unwind_lazy_gen, &tgid, &gen, BPF_NOEXIST)) {
			g = bpf_map_lookup_elem(&unwind_lazy_gen, &tgid); /* another CPU's */
			if (!g)
				return 0;
			gen = *g;
		}
	}
	p->p.nr = 0;
	p->p.gen = gen;
	return &p->p;
}

static __always_inline int mt_unwind_cfi(const struct mt_uregs *r, int ret_at,
					 struct mt_stack *out)
{
	struct mt_walk_io *io;
	struct mt_memo_key *k;
	struct mt_unwind_proc *proc;
	struct mt_unwind_win *win;
	struct mt_memo_ent *e;
	__u32 tgid = r->tgid;
	__u32 zero = 0, slot, n, epoch, hs = 0, key_end = 0;
	__u64 *ep;

	if (unwind_disabled)
		return -1;
	ep = bpf_map_lookup_elem(&unwind_epoch, &zero);
	if (!ep || !*ep) /* no tables anywhere yet */
		return -1;
	epoch = (__u32)*ep;
	win = bpf_map_lookup_elem(&unwind_win, &zero);
	if (!win) /* (never: index 0 of a per-CPU array) */
		return -1;
	io = &win->io;
	k = &win->key;
	__builtin_memset(io, 0, sizeof(*io));
	__builtin_memset(k, 0, sizeof(*k));
	win->len = 0; /* nothing of this stack read yet */
	win->floor = r->sp;
	win->top = r->start_stack > r->sp ? (r->start_stack + 4095) & ~4095ULL : 0;
	io->exact_pc = (__u32)ret_at >> 31; /* not an entry probe: pc is exact */
	io->sp = r->sp;
	io->bp = r->bp;
	io->pc = r->ip;
#ifdef __TARGET_ARCH_arm64
	if (ret_at >= 0) {
		/* Entry probe: bl left the return address in x30, and the
		 * probe's placement moved sp by ret_at (nothing read) */
		io->pc = r->lr & MT_ARM64_VA_MASK;
		io->sp = r->sp + ret_at;
		if (!io->pc) {
			out->nr = 0;
			return MT_F_NO_STACK;
		}
	} else {
		io->lr = r->lr;
	}
#else
	if (ret_at >= 0) {
		/* Entry probe: the return address is at [rsp + ret_at], rbp is
		 * still the caller's. (This read fills the window the memo
		 * replay or the walk go on with.) */
		struct mt_unwind_pair p;
		__u64 ra = io->sp + ret_at;

		hs = (__u32)(((ra ^ ((__u64)tgid << 20)) * 0x9E3779B97F4A7C15ULL) >> 40) &
		     (MT_FIRST_HINTS - 1);
		/* As much as the last stack taken here needed, in one copy
		 * (else the 2 KiB window of mt_uread16) */
		mt_first_read(win, ra, win->first_hint[hs]);
		if (mt_uread16_fast(win, ra, &p) || !p.a) {
			out->nr = 0;
			return MT_F_NO_STACK;
		}
		io->pc = p.a;
		io->sp = ra + 8;
		if (win->len && ra >= win->base && ra + 16 - win->base <= win->len)
			key_end = ra + 16 - win->base; /* (else no window: read directly) */
	}
#endif
	win->base0 = win->base;
	win->len0 = win->len;

	/* Memo key: rsp and the first frame (the call site), so that two
	 * call paths reaching the allocator at the same depth do not take
	 * turns evicting each other. */
	k->sp = r->sp;
	k->bp = r->bp;
	k->pc = io->pc;
	k->ret_at = ret_at;
	k->epoch = epoch;
	k->tgid = tgid;
	k->slot = (__u32)(((r->sp ^ (io->pc * 0xC2B2AE3D27D4EB4FULL) ^ ((__u64)epoch << 40) ^
			   ((__u64)tgid << 20) ^ (__u64)(__u32)ret_at) * 0x9E3779B97F4A7C15ULL) >> 40) &
		 unwind_memo_mask & ~(MT_MEMO_WAYS - 1);
	win->clock++;
	if (mt_memo_lookup(win, k, out) == 0) {
		mt_unwind_count(MT_UC_MEMO_HITS);
		if (key_end)
			win->first_hint[hs & (MT_FIRST_HINTS - 1)] = k->first_len;
		return mt_unwind_done(k->nr, k->frames_fp, k->reason);
	}
	/* A miss: the walk needs this process's tables; none published yet:
	 * an empty value, every row through the pc's VMA (mt_unwind_vma_mapping). */
	proc = bpf_map_lookup_elem(&unwind_procs, &tgid);
	if (!proc) {
		proc = mt_unwind_noproc(tgid);
		if (!proc)
			return -1;
	}
	io->gen = proc->gen;
	slot = k->slot;
	e = bpf_map_lookup_elem(&unwind_memo, &slot);
	if (!e)
		return -1;
	e->used = win->clock;
	e->gen = 0; /* being rewritten by the walk below */
	e->nw = 0;
	e->bp_mem = 0;
	e->bp0_used = 0;
	out->ips[0] = io->pc;
	io->n = 1;
	io->h = mt_hash_step(MT_HASH_SEED, io->pc);
#ifdef MT_UNWIND_CACHE_STATS
	{
		__u64 sp0 = r->sp;
		if (mt_unwind_walk(io, out, win, proc, e))
			return -1;
		mt_unwind_add(MT_UC_COUNT + 4, io->sp - sp0);
	}
#else
	if (mt_unwind_walk(io, out, win, proc, e))
		return -1;
#endif
	n = io->n > MT_MAX_FRAMES ? MT_MAX_FRAMES : io->n;
	out->nr = n;
	out->stack_id = io->h ? io->h : 1; /* = mt_stack_hash(out): no second pass */
	if (io->reason != MT_UC_TRUNC_READ && e->nw <= MT_MEMO_WORDS) {
		e->sp = r->sp;
		e->ip = io->pc;
		e->bp = e->bp0_used ? r->bp : 0;
		e->stack_id = out->stack_id;
		e->ret_at = ret_at;
		e->nr = n;
		e->flags = e->bp0_used ? MT_MEMO_F_BP : 0;
		e->reason = io->reason;
		e->frames_fp = io->frames_fp;
		e->tgid = tgid;
		mt_memo_plan(e, win->base0, key_end, r->sp);
		if (key_end)
			win->first_hint[hs & (MT_FIRST_HINTS - 1)] = e->first_len;
		e->gen = epoch; /* last: the entry is valid from here */
	}
	return mt_unwind_done(n, io->frames_fp, io->reason);
}

#endif
