/* Python frames at an allocator hit (issue 32): the calling thread's own
 * CPython frame chain, read through the interpreter's TSS key and glibc's
 * TSD (struct mt_py_proc in memtrace.h says where), appended to the stack
 * record as (code object, prev_instr | MT_PY_ENTRY) pairs and folded into
 * its hash. Included by memtrace.bpf.c after count().
 *
 * x86-64 only (fsbase from the task; arm64's tpidr_el0 and glibc's TCB
 * there are not done), full build only (the code records' loop is
 * bpf_loop, 5.17): elsewhere it adds nothing. Cost: five reads to get
 * to the innermost frame, one MT_PY_WINDOW-byte read per frame. */
#ifndef MT_PYTHON_BPF_H
#define MT_PYTHON_BPF_H

const volatile bool python_frames = false; /* --python-frames on|only and a CPython seen */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32); /* tgid */
	__type(value, struct mt_py_proc);
} py_procs SEC(".maps");

/* One frame's window (a map value: its bytes are read at offsets the
 * loader gives, which a 5.10 verifier refuses on the BPF stack). */
struct mt_py_window {
	__u8 b[128];
};
#define MT_PYC_WINDOW 80 /* a code object's bytes from co_firstlineno on (3.11: 72..151) */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_py_window);
} py_window SEC(".maps");

static __always_inline __u64 mt_py_u64(const struct mt_py_window *w, __u32 off)
{
	if (off > MT_PY_WINDOW_OWNER - 8)
		off = MT_PY_WINDOW_OWNER - 8;
	return *(const __u64 *)&w->b[off];
}

/* Code objects already sent (MT_EV_PYCODE), by tgid, address and
 * fingerprint. LRU: one evicted is sent again (harmless). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1 << 16);
	__type(key, struct mt_py_code_key);
	__type(value, __u8);
} py_code_seen SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mt_py_code);
} py_code_scratch SEC(".maps");

static __always_inline __u32 mt_py_u32(const struct mt_py_window *w, __u32 off)
{
	if (off > MT_PYC_WINDOW - 4)
		off = MT_PYC_WINDOW - 4;
	return *(const __u32 *)&w->b[off];
}

static __always_inline __u64 mt_pyc_u64(const struct mt_py_window *w, __u32 off)
{
	if (off > MT_PYC_WINDOW - 8)
		off = MT_PYC_WINDOW - 8;
	return *(const __u64 *)&w->b[off];
}

#if defined(__TARGET_ARCH_x86) && !defined(MT_COMPAT)
/* A compact ASCII str's characters into out (NUL-ended); false: not one. */
static __always_inline bool mt_py_str(const struct mt_py_proc *pp, __u64 str, char *out, __u32 size)
{
	__u32 state = 0;
	out[0] = 0;
	if (!str || bpf_probe_read_user(&state, sizeof(state), (void *)(str + pp->str_state)))
		return false;
	if (!((state >> 5) & 1) || !((state >> 6) & 1)) /* compact, ascii */
		return false;
	return bpf_probe_read_user_str(out, size, (void *)(str + pp->str_ascii_data)) > 0;
}
#endif

/* A new stack's code objects not sent yet, each as an MT_EV_PYCODE record
 * ahead of the stack (its pairs after its nr native frames in
 * stack_scratch). One bpf_loop step per Python frame: a bounded loop of
 * these made the verifier walk every path of every iteration (minutes). */
struct mt_pyc_ctx {
	__u64 pid_tgid;
	__u32 n, py;
};

#if defined(__TARGET_ARCH_x86) && !defined(MT_COMPAT)
static long mt_pyc_step(__u32 i, void *data)
{
	struct mt_pyc_ctx *c = data;
	struct mt_py_code_key k = {};
	struct mt_py_proc *pp;
	struct mt_py_window *w;
	struct mt_py_code *rec;
	struct mt_stack *s;
	__u32 zero = 0, tgid = c->pid_tgid >> 32, len;
	__u64 code, lt = 0, size = 0;
	__u8 one = 1;

	if (i >= c->py)
		return 1;
	pp = bpf_map_lookup_elem(&py_procs, &tgid);
	w = bpf_map_lookup_elem(&py_window, &zero);
	rec = bpf_map_lookup_elem(&py_code_scratch, &zero);
	s = bpf_map_lookup_elem(&stack_scratch, &zero);
	if (!pp || !w || !rec || !s)
		return 1;
	code = s->ips[(c->n + 2 * i) & (MT_STACK_SLOTS - 1)];
	if (!code) /* an entry's shim (MT_PY_SHIM) */
		return 0;
	if (bpf_probe_read_user(w->b, MT_PYC_WINDOW, (void *)(code + pp->co_firstlineno)))
		return 0; /* the loader names it "?" (python_code_unreadable) */
	k.tgid = tgid;
	k.code = code;
	k.first_line = (__s32)mt_py_u32(w, 0);
	k.name = mt_pyc_u64(w, pp->co_qualname - pp->co_firstlineno);
	k.file = mt_pyc_u64(w, pp->co_filename - pp->co_firstlineno);
	if (bpf_map_lookup_elem(&py_code_seen, &k))
		return 0;
	lt = mt_pyc_u64(w, pp->co_linetable - pp->co_firstlineno);
	fill_hdr(&rec->h, MT_EV_PYCODE, 0, c->pid_tgid);
	rec->code = code;
	rec->first_line = k.first_line;
	rec->flags = 0;
	rec->table_len = 0;
	if (!mt_py_str(pp, k.name, rec->name, MT_PY_NAME_LEN) || !mt_py_str(pp, k.file, rec->file, MT_PY_FILE_LEN))
		rec->flags |= MT_PYC_NONASCII;
	if (!lt || bpf_probe_read_user(&size, sizeof(size), (void *)(lt + pp->bytes_size))) {
		rec->flags |= MT_PYC_UNREADABLE;
	} else {
		if (size > MT_PY_TABLE_LEN)
			rec->flags |= MT_PYC_TABLE_CUT;
		len = size > MT_PY_TABLE_LEN ? MT_PY_TABLE_LEN : (__u32)size;
		len &= (MT_PY_TABLE_LEN * 2 - 1);
		if (len > MT_PY_TABLE_LEN)
			len = MT_PY_TABLE_LEN;
		if (len && bpf_probe_read_user(rec->table, len, (void *)(lt + pp->bytes_data)))
			rec->flags |= MT_PYC_UNREADABLE;
		else
			rec->table_len = len;
	}
	if (bpf_ringbuf_output(&events, rec, sizeof(*rec), rb_flags())) {
		count(MT_C_PY_CODE_RINGBUF_FULL);
		return 0;
	}
	bpf_map_update_elem(&py_code_seen, &k, &one, BPF_ANY);
	return 0;
}

/* Subprograms of their own (mt_py_walk too): their locals are not in the
 * probe's frame, which heads the unwinder's call chain, and the verifier
 * holds a chain's frames to 512 bytes (tests/bpf/stack_depth.py). */
static __noinline void mt_py_send_codes(struct mt_stack *s, __u64 pid_tgid)
{
	struct mt_pyc_ctx c = {.pid_tgid = pid_tgid, .n = s->nr, .py = s->py_nr};
	if (!c.py)
		return;
	if (c.n > MT_MAX_FRAMES)
		c.n = MT_MAX_FRAMES;
	bpf_loop(MT_MAX_PY_FRAMES, mt_pyc_step, &c, 0);
}
#else
/* The compat build (kernels before 5.17: no bpf_loop) and arm64: no Python frames. */
static __always_inline void mt_py_send_codes(struct mt_stack *s, __u64 pid_tgid) {}
#endif

#if defined(__TARGET_ARCH_x86) && !defined(MT_COMPAT)
/* The frame chain, one bpf_loop step per frame: as a bounded loop of 65
 * iterations the verifier walked each one (6.12 under qemu: 7 of a
 * launch's 15 s of load; tests/kernels). */
struct mt_pyw_ctx {
	struct mt_py_proc *pp; /* looked up once: a hash lookup per frame cost W1 ~9% */
	struct mt_py_window *w;
	struct mt_stack *s;
	__u64 frame, h;
	__u32 n, py;
};

/* Frame k of the walk (k = the pairs so far: every frame adds one). 1:
 * the walk ends. */
static __always_inline long mt_pyw_frame(struct mt_pyw_ctx *c, __u32 k)
{
	struct mt_py_proc *pp = c->pp;
	struct mt_py_window *w = c->w;
	struct mt_stack *s = c->s;
	__u32 e, at;
	__u64 code, instr;

	if (!c->frame || !pp || !w || !s)
		return 1;
	if (k >= MT_MAX_PY_FRAMES) {
		count(MT_C_PY_CUT);
		return 1;
	}
	if (bpf_probe_read_user(w->b, (pp->flags & MT_PYP_OWNER) ? MT_PY_WINDOW_OWNER : MT_PY_WINDOW,
				(void *)(c->frame + pp->frame_window))) {
		count(MT_C_PY_READ_FAILED);
		return 1;
	}
	code = mt_py_u64(w, pp->w_code);
	instr = mt_py_u64(w, pp->w_prev_instr);
	e = pp->w_is_entry;
	if (e > MT_PY_WINDOW_OWNER - 1)
		e = MT_PY_WINDOW_OWNER - 1;
	if (pp->flags & MT_PYP_OWNER) {
		/* an entry's shim: a pair of its own, the frame above it the
		 * entry frame (src/python's splice) */
		if (w->b[e] == pp->owner_cstack) {
			code = 0;
			instr = MT_PY_SHIM;
		}
	} else if (w->b[e]) {
		instr |= MT_PY_ENTRY;
	}
	/* k from the step number, not c->py (equal): an index must be
	 * precise, and a count precise across steps makes each step a state
	 * of its own to the verifier (65 walks of the body) */
	at = c->n + 2 * k;
	s->ips[at & (MT_STACK_SLOTS - 1)] = code;
	s->ips[(at + 1) & (MT_STACK_SLOTS - 1)] = instr;
	c->h = mt_hash_step(mt_hash_step(c->h, code), instr);
	c->py++;
	c->frame = mt_py_u64(w, pp->w_previous);
	return 0;
}

/* MT_PYW_UNROLL frames a step: one callback call per frame cost W1 ~4%
 * over the bounded loop this replaced. */
#define MT_PYW_UNROLL 4
static long mt_pyw_step(__u32 i, void *data)
{
	struct mt_pyw_ctx *c = data;
#pragma unroll
	for (__u32 j = 0; j < MT_PYW_UNROLL; j++)
		if (mt_pyw_frame(c, i * MT_PYW_UNROLL + j))
			return 1;
	return 0;
}
#endif

/* s: the stack with its native frames (s->nr); h: their hash. Returns the
 * hash with the Python pairs folded in; sets s->py_nr. */
#if defined(__TARGET_ARCH_x86) && !defined(MT_COMPAT)
static __noinline
#else
static __always_inline
#endif
__u64 mt_py_walk(struct mt_stack *s, __u32 tgid, __u64 h)
{
	s->py_nr = 0;
#if defined(__TARGET_ARCH_x86) && !defined(MT_COMPAT)
	struct mt_py_proc *pp;
	__s32 tss[2];
	__u64 fsbase, tstate = 0, cframe = 0, frame = 0;

	if (!python_frames)
		return h;
	pp = bpf_map_lookup_elem(&py_procs, &tgid);
	if (!pp)
		return h;
	fsbase = bpf_get_current_task_btf()->thread.fsbase;
	if (pp->flags & MT_PYP_TLS) {
		/* 3.13: _Py_tss_tstate, NULL while the thread is detached
		 * (the GIL released: then through the TSS key below, if the
		 * loader found it) */
		if (bpf_probe_read_user(&tstate, sizeof(tstate), (void *)(fsbase + (__s64)pp->tls_off))) {
			count(MT_C_PY_READ_FAILED);
			return h;
		}
	}
	if (!tstate && pp->tss_addr) {
		/* autoTSSkey: {int _is_initialized; pthread_key_t _key} */
		if (bpf_probe_read_user(tss, sizeof(tss), (void *)pp->tss_addr)) {
			count(MT_C_PY_READ_FAILED);
			return h;
		}
		if (!tss[0] || tss[1] < 0 || tss[1] >= 32) {
			/* not initialized yet (start-up), or a key past glibc's first block */
			count(tss[0] && tss[1] >= 32 ? MT_C_PY_READ_FAILED : MT_C_PY_NO_TSTATE);
			return h;
		}
		if (bpf_probe_read_user(&tstate, sizeof(tstate), (void *)(fsbase + pp->tsd_off + (__u64)tss[1] * 16 + 8))) {
			count(MT_C_PY_READ_FAILED);
			return h;
		}
	}
	if (!tstate) {
		count(MT_C_PY_NO_TSTATE);
		return h;
	}
	if (bpf_probe_read_user(&cframe, sizeof(cframe), (void *)(tstate + pp->tstate_cframe))) {
		count(MT_C_PY_READ_FAILED);
		return h;
	}
	if (pp->flags & MT_PYP_NO_CFRAME) {
		frame = cframe; /* 3.13: tstate->current_frame itself (NULL: no frames yet) */
	} else {
		if (!cframe) { /* a thread state being made or torn down: no frames */
			count(MT_C_PY_NO_TSTATE);
			return h;
		}
		if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(cframe + pp->cframe_current))) {
			count(MT_C_PY_READ_FAILED);
			return h;
		}
	}
	struct mt_pyw_ctx c = {.frame = frame, .h = h, .n = s->nr, .pp = pp, .s = s};
	__u32 zero = 0;
	c.w = bpf_map_lookup_elem(&py_window, &zero);
	if (!c.w)
		return h;
	if (c.n > MT_MAX_FRAMES)
		c.n = MT_MAX_FRAMES;
	bpf_loop((MT_MAX_PY_FRAMES + MT_PYW_UNROLL) / MT_PYW_UNROLL, mt_pyw_step, &c, 0);
	s->py_nr = c.py;
	h = c.h;
#endif
	return h ? h : 1;
}

#endif
