/* CFI unwinder, part 2 of 4 (included by unwind.bpf.h): the walk's
 * context and the row of a pc: the binary searches over a process's
 * mappings and a file's rows, rows through the VMA for processes not
 * read yet, and the two row caches in front of them. */
#ifndef MT_UNWIND_ROWS_BPF_H
#define MT_UNWIND_ROWS_BPF_H

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

#ifndef MT_COMPAT /* (the compat object's searches: mt_bsearch_compat below) */
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
#endif

#ifdef MT_COMPAT
/* The compat object's searches: bounded loops whose lo and hi live in map
 * memory, an unknown number to the verifier at each load, so that both
 * halves of an iteration meet at the next one (kept on the stack, they were
 * constants it followed exactly: 2^steps paths, 222k instructions for one
 * frame step). */
struct mt_bsearch_lohi {
	__u32 lo, hi;
};
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_bsearch_lohi);
} unwind_bsearch SEC(".maps");

/* b->lo, b->hi: as the bpf_loop of mt_bsearch_row_step (rows) or
 * mt_bsearch_map_step (b->proc's mappings) leaves them. */
static __always_inline void mt_bsearch_compat(struct mt_bsearch *b, int rows, int steps)
{
	struct mt_bsearch_lohi *v;
	__u32 zero = 0;

	v = bpf_map_lookup_elem(&unwind_bsearch, &zero);
	if (!v || (!rows && !b->proc)) {
		b->lo = b->hi = 0;
		return;
	}
	v->lo = b->lo;
	v->hi = b->hi;
	for (int i = 0; i < steps; i++) {
		__u32 lo, hi, mid;
		__u64 key;

		asm volatile("" ::: "memory"); /* loads, not what clang knows was stored */
		lo = v->lo;
		hi = v->hi;

		if (lo >= hi)
			break;
		mid = lo + (hi - lo) / 2;
		if (rows) {
			struct mt_unwind_row *r = mt_row(mid);
			if (!r) {
				v->lo = v->hi = 0;
				break;
			}
			key = r->pc;
		} else {
			key = b->proc->m[mid & (MT_UNWIND_MAX_MAPPINGS - 1)].start;
		}
		if (key <= b->x)
			v->lo = mid + 1;
		else
			v->hi = mid;
	}
	asm volatile("" ::: "memory");
	b->lo = v->lo;
	b->hi = v->hi;
}
#define MT_BSEARCH_ROWS(b) mt_bsearch_compat((b), 1, MT_UNWIND_ROW_STEPS)
#define MT_BSEARCH_MAPS(b) mt_bsearch_compat((b), 0, MT_UNWIND_MAP_STEPS)
#else
#define MT_BSEARCH_ROWS(b) bpf_loop(MT_UNWIND_ROW_STEPS, mt_bsearch_row_step, (b), 0)
#define MT_BSEARCH_MAPS(b) bpf_loop(MT_UNWIND_MAP_STEPS, mt_bsearch_map_step, (b), 0)
#endif

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
	MT_BSEARCH_ROWS(b);
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
	MT_BSEARCH_MAPS(b);
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
MT_GLOBAL int mt_unwind_row_miss(struct mt_unwind_proc *proc, __u64 lookup,
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
#endif /* MT_UNWIND_ROWS_BPF_H */
