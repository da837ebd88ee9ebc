/* libmemtrace_agent.so: loaded into a running process by `memtrace-bpf
 * --inject` (src/inject/injector.cpp makes the target call dlopen), it
 * routes the malloc family to itself and writes one record per call into
 * the loader's shared-memory ring (src/inject/ring.h).
 *
 * How calls reach it: the constructor rewrites the GOT slots (JUMP_SLOT and
 * GLOB_DAT relocations) naming malloc, free, calloc, realloc, reallocarray,
 * posix_memalign, aligned_alloc, memalign, valloc, pvalloc and dlopen in
 * every loaded object but itself and ld.so (dl_iterate_phdr; RELRO pages
 * are made writable for the write and read-only again). libc's own slots
 * too: glibc calls malloc through its GOT (strdup, fopen, getline, printf's
 * buffers), which valgrind and the BPF path count. A hook calls libc's
 * function (dlsym RTLD_NEXT, resolved once), then writes the record.
 * dlopen's hook rewrites the objects it brought too.
 *
 * Safe for the target: plain C, no C++ runtime; a thread-local flag
 * (initial-exec TLS: a dlopen'd library's dynamic TLS would itself call
 * malloc) makes every allocation made while a hook runs (libunwind's,
 * pthread_getattr_np's) call straight through; a full ring drops the record;
 * the loader's DETACHED state, a heartbeat older than MT_INJ_STALE_NS (the
 * loader was killed) or a fork (the child's) make the hooks call straight
 * through for good. A full ring makes the writer wait for the loader's
 * drain (50 us naps) while the loader's heartbeat is fresh, and drop the
 * record only when it is not. Frame-pointer walks stay inside the
 * thread's stack, above the hook's own frame. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "memtrace.h"
#include "inject/agent_unwind.h"
#include "inject/ring.h"

#define TLS __attribute__((tls_model("initial-exec"))) __thread
#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* One session's ring, as this process maps it. A later --inject into the
 * same process (memtrace_agent_attach) makes a new one; the old one stays
 * mapped (a hook that read it may still write there; its data pages are
 * given back), so a hook uses the view it started with throughout. */
struct view {
  struct mt_inj_hdr* hdr;
  char* data;
  uint64_t mask;
  uint64_t* seen;  /* stacks already sent (first_sight) */
  int stack_mode;
  struct mt_cfi cfi; /* MT_INJ_STACK_CFI: the loader's rows, this session's memo */
  int cfi_verify;    /* MT_INJ_CFI_VERIFY */
  int tsc;         /* records carry the TSC */
  int py;          /* walk CPython's frames (hdr py_frames; pyp says where) */
  struct mt_py_proc pyp;
  volatile int off; /* this session's writing is over: fork child, stale loader */
};
static struct view* g_view; /* the current session's (atomic loads and stores) */
static TLS struct view* t_v; /* the view of the hook running on this thread */
static uint32_t g_pid;
/* forks under way in this process (between the agent's prepare and parent
 * atfork handlers; see in_fork_child) */
static uint32_t g_forking;

static TLS int t_in_hook;
static TLS uint32_t t_tid;
static TLS uint32_t t_count;
static TLS uintptr_t t_stack_lo, t_stack_hi;
/* A C++ aligned operator new of this thread is running: the size it was
 * asked for (its aligned_alloc/posix_memalign/memalign gets it rounded up
 * to the alignment in libstdc++). 0: none. */
static TLS size_t t_new_size;
static TLS int t_new_pending;

/* The allocator's own functions, as dlsym(RTLD_NEXT) finds them from here
 * (libc's). Not through this library's PLT: in a non-PIE program that takes
 * malloc's address (python3) the whole process's malloc is the program's
 * PLT entry, whose GOT slot is rewritten. */
static struct {
  void* (*malloc)(size_t);
  void (*free)(void*);
  void* (*calloc)(size_t, size_t);
  void* (*realloc)(void*, size_t);
  void* (*reallocarray)(void*, size_t, size_t);
  int (*posix_memalign)(void**, size_t, size_t);
  void* (*aligned_alloc)(size_t, size_t);
  void* (*memalign)(size_t, size_t);
  void* (*valloc)(size_t);
  void* (*pvalloc)(size_t);
  void* (*dlopen)(const char*, int);
  /* The C++ runtime's aligned operator new (libstdc++), NULL where none is
   * loaded: operator new(size_t, align_val_t) and new[], and their nothrow
   * forms. */
  void* (*new_al)(size_t, size_t);
  void* (*new_arr_al)(size_t, size_t);
  void* (*new_al_nt)(size_t, size_t, const void*);
  void* (*new_arr_al_nt)(size_t, size_t, const void*);
} real;

typedef int (*unw_backtrace_fn)(void**, int);
static unw_backtrace_fn g_unw_backtrace;

/* ---- the ring: reserve, fill, commit. */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A record's time: the TSC where the loader said the kernel keeps time by
 * it (~10 ns against ~24 for clock_gettime's vDSO here; the loader converts),
 * else CLOCK_MONOTONIC. */
static inline uint64_t now_ts(void) {
#if defined(__x86_64__)
  if (LIKELY(t_v->tsc)) return __builtin_ia32_rdtsc();
#endif
  return now_ns();
}

/* Whether the loader is there: its heartbeat is fresh, or it is late but
 * the loader's process still exists (a tool starved of CPU on a loaded
 * host, up to MT_INJ_STALE_MAX_NS). Gone (SIGKILL, OOM): this session's
 * writing is over for good. */
static int loader_alive(struct view* v) {
  /* The heartbeat read after the clock: a drain between the two leaves it
   * newer than now (an unsigned age would wrap to "stale" and end the
   * session's records silently). */
  uint64_t now = now_ns();
  uint64_t hb = __atomic_load_n(&v->hdr->heartbeat_ns, __ATOMIC_ACQUIRE);
  if (LIKELY(hb >= now || now - hb <= MT_INJ_STALE_NS)) return 1;
  uint64_t age = now - hb;
  pid_t loader = (pid_t)v->hdr->loader_pid;
  if (age <= MT_INJ_STALE_MAX_NS && loader > 0 && (kill(loader, 0) == 0 || errno == EPERM)) return 1;
  v->off = 1;
  return 0;
}

/* Space for len bytes (a multiple of 8) after the record word; NULL when
 * full. *pos: the record's position, for commit. */
static void* reserve(uint32_t len, uint64_t* pos) {
  uint64_t need = MT_INJ_REC_HDR + len, size = t_v->mask + 1;
  uint64_t h = __atomic_load_n(&t_v->hdr->head, __ATOMIC_RELAXED);
  for (;;) {
    uint64_t t = __atomic_load_n(&t_v->hdr->tail, __ATOMIC_ACQUIRE);
    uint64_t off = h & t_v->mask;
    uint64_t pad = off + need > size ? size - off : 0;
    if (h + pad + need - t > size) {
      /* Full: wait for the loader's drain while it lives and wants records
       * (exact counts: a drop is the last resort), never longer than a
       * stale heartbeat. A raw nanosleep: not a cancellation point inside
       * the program's malloc. */
      if (t_v->off || __atomic_load_n(&t_v->hdr->state, __ATOMIC_RELAXED) != MT_INJ_ATTACHED || !loader_alive(t_v)) {
        __atomic_fetch_add(&t_v->hdr->drops, 1, __ATOMIC_RELAXED);
        return NULL;
      }
      struct timespec nap = {0, 50000};
      syscall(SYS_nanosleep, &nap, NULL);
      __atomic_fetch_add(&t_v->hdr->full_waits, 1, __ATOMIC_RELAXED);
      h = __atomic_load_n(&t_v->hdr->head, __ATOMIC_RELAXED);
      continue;
    }
    if (__atomic_compare_exchange_n(&t_v->hdr->head, &h, h + pad + need, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      if (pad)
        __atomic_store_n((uint64_t*)(t_v->data + off), pad << 48 | MT_INJ_PAD | (h & MT_INJ_POS_MASK),
                         __ATOMIC_RELEASE);
      *pos = h + pad;
      return t_v->data + ((h + pad) & t_v->mask) + MT_INJ_REC_HDR;
    }
  }
}

static void commit(uint64_t pos, uint32_t len) {
  __atomic_store_n((uint64_t*)(t_v->data + (pos & t_v->mask)), (uint64_t)(MT_INJ_REC_HDR + len) << 48 | (pos & MT_INJ_POS_MASK),
                   __ATOMIC_RELEASE);
}

/* ---- stacks. */

static uint32_t tid_of_thread(void) {
  if (UNLIKELY(!t_tid)) t_tid = (uint32_t)syscall(SYS_gettid);
  return t_tid;
}

static void thread_stack_bounds(void) {
  pthread_attr_t a;
  void* lo = NULL;
  size_t sz = 0;
  t_stack_hi = 1; /* tried */
  if (pthread_getattr_np(pthread_self(), &a) != 0) return;
  if (pthread_attr_getstack(&a, &lo, &sz) == 0) {
    t_stack_lo = (uintptr_t)lo;
    t_stack_hi = (uintptr_t)lo + sz;
  }
  pthread_attr_destroy(&a);
}

/* Frame pointers from the hook's caller on; ips[0] = ret (the hook's return
 * address: the call site in the caller). */
static int fp_stack(uint64_t* ips, int max, void* ret, uintptr_t bp) {
  int n = 0;
  ips[n++] = (uint64_t)(uintptr_t)ret;
  if (UNLIKELY(!t_stack_hi)) thread_stack_bounds();
  /* Callers' frames lie between the hook's own frame and the stack's top:
   * every byte there is mapped (below it, in the range pthread gives for
   * the main thread, may not be). rbp of code without frame pointers is any
   * value: it is followed only while it stays in there, going up. */
  uintptr_t lo = bp > t_stack_lo ? bp : t_stack_lo, hi = t_stack_hi;
  /* bp <= hi - 16, not bp + 16 <= hi: an rbp of -16 wraps around. */
  if (hi < lo + 16) return n;
  if (bp >= lo && bp <= hi - 16) bp = ((uintptr_t*)bp)[0]; /* the hook's caller's frame: its return address is ips[0] */
  while (n < max && bp >= lo && bp <= hi - 16 && !(bp & 7)) {
    uintptr_t next = ((uintptr_t*)bp)[0];
    uintptr_t ra = ((uintptr_t*)bp)[1];
    if (ra < 4096) break;
    ips[n++] = ra;
    if (next <= bp) break;
    bp = next;
  }
  return n;
}

static uint64_t hash_stack(const uint64_t* ips, int n) {
  uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)n;
  for (int i = 0; i < n; i++) {
    h ^= ips[i];
    h *= 0x100000001b3ull;
    h ^= h >> 29;
  }
  h &= ~(1ull << 63); /* the model's sealed stacks have the top bit */
  return h ? h : 1;
}

/* Stacks already sent: open addressing, lock-free insert. */
#define SEEN_BITS 20

/* 1: id is new (send its stack), 0: sent before. */
static int first_sight(uint64_t id) {
  if (!t_v->seen) return 1;
  uint64_t mask = (1ull << SEEN_BITS) - 1, i = (id * 0x9e3779b97f4a7c15ull) >> (64 - SEEN_BITS);
  for (int probe = 0; probe < 64; probe++, i = (i + 1) & mask) {
    uint64_t v = __atomic_load_n(&t_v->seen[i], __ATOMIC_RELAXED);
    if (v == id) return 0;
    if (v == 0) {
      uint64_t expect = 0;
      if (__atomic_compare_exchange_n(&t_v->seen[i], &expect, id, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return 1;
      if (expect == id) return 0;
    }
  }
  __atomic_fetch_add(&t_v->hdr->stack_table_full, 1, __ATOMIC_RELAXED);
  return 1;
}

/* ---- Python frames (issue 32): the BPF walk's (bpf/python.bpf.h), in
 * the process. The calling thread's own PyThreadState (a C extension
 * allocates with the GIL released: never the GIL holder's) is the value of
 * the interpreter's TSS key; its frame chain is this thread's, changed
 * only by this thread, and every pointer of it is followed as the
 * interpreter itself follows it. A pair per frame, innermost first: the
 * code object, prev_instr | MT_PY_ENTRY for an entry frame. */

/* The canonical lower half, 8-byte aligned: a field of a live object. */
static inline int py_ptr_ok(uint64_t p) { return p >= 4096 && p < (1ull << 47) && !(p & 7); }

static int py_walk(const struct mt_py_proc* pp, uint64_t* out, int max_pairs) {
  uint64_t ts;
  if (pp->flags & MT_PYP_TLS) {
#if defined(__x86_64__)
    /* 3.13: _Py_tss_tstate, a TLS variable of the executable (NULL while
     * the thread is detached) */
    __asm__ volatile("movq %%fs:(%1), %0" : "=r"(ts) : "r"((int64_t)pp->tls_off));
#else
    return 0;
#endif
  } else {
    const int32_t* tss = (const int32_t*)(uintptr_t)pp->tss_addr;
    /* autoTSSkey: {int _is_initialized; pthread_key_t _key}; 0 before the
     * runtime's start and after its end */
    if (!__atomic_load_n(&tss[0], __ATOMIC_RELAXED)) return 0;
    ts = (uint64_t)(uintptr_t)pthread_getspecific((pthread_key_t)tss[1]);
  }
  if (!py_ptr_ok(ts)) return 0;
  uint64_t cf = *(const uint64_t*)(uintptr_t)(ts + pp->tstate_cframe), f;
  if (pp->flags & MT_PYP_NO_CFRAME) {
    f = cf; /* 3.13: tstate->current_frame */
  } else {
    if (!py_ptr_ok(cf)) return 0; /* a thread state being made or torn down */
    f = *(const uint64_t*)(uintptr_t)(cf + pp->cframe_current);
  }
  int n = 0, shims = 0;
  while (py_ptr_ok(f) && n < max_pairs) {
    const char* w = (const char*)(uintptr_t)(f + pp->frame_window);
    uint64_t code, instr, prev;
    memcpy(&code, w + pp->w_code, 8);
    memcpy(&instr, w + pp->w_prev_instr, 8);
    memcpy(&prev, w + pp->w_previous, 8);
    if (pp->flags & MT_PYP_OWNER) {
      if ((uint8_t)w[pp->w_is_entry] == pp->owner_cstack) {
        /* an entry's shim: the frame above it is the entry frame */
        if (n) out[2 * n - 1] |= MT_PY_ENTRY;
        if (++shims > max_pairs) break; /* no chain has more shims than frames */
        f = prev;
        continue;
      }
      if (!py_ptr_ok(code)) break;
      out[2 * n] = code;
      out[2 * n + 1] = instr;
    } else {
      if (!py_ptr_ok(code)) break;
      out[2 * n] = code;
      out[2 * n + 1] = instr | (w[pp->w_is_entry] ? MT_PY_ENTRY : 0);
    }
    n++;
    f = prev;
  }
  if (n == max_pairs && py_ptr_ok(f)) __atomic_fetch_add(&t_v->hdr->py_cut, 1, __ATOMIC_RELAXED);
  return n;
}

/* A compact ASCII str's characters (PEP 393) into out, NUL-ended; 0: not one. */
static int py_str(const struct mt_py_proc* pp, uint64_t str, char* out, size_t size) {
  out[0] = 0;
  if (!py_ptr_ok(str)) return 0;
  uint32_t state;
  memcpy(&state, (const char*)(uintptr_t)(str + pp->str_state), sizeof state);
  if (!((state >> 5) & 1) || !((state >> 6) & 1)) return 0; /* compact, ascii */
  const char* c = (const char*)(uintptr_t)(str + pp->str_ascii_data);
  size_t len = strnlen(c, size - 1);
  memcpy(out, c, len);
  out[len] = 0;
  return 1;
}

/* The code objects of pairs[0..py) not sent yet (their fingerprint, the
 * BPF side's py_code_seen key: address, first line, name and file
 * pointers; a freed code object's address reused by another gets a record
 * of its own), each as an MT_EV_PYCODE record ahead of the stack that
 * names them: the loader names the frames from these, whenever it drains. */
static void py_send_codes(const struct mt_py_proc* pp, const uint64_t* pairs, int py) {
  for (int i = 0; i < py; i++) {
    uint64_t code = pairs[2 * i], name, file, lt;
    int32_t first;
    const char* co = (const char*)(uintptr_t)code;
    memcpy(&first, co + pp->co_firstlineno, sizeof first);
    memcpy(&name, co + pp->co_qualname, 8);
    memcpy(&file, co + pp->co_filename, 8);
    memcpy(&lt, co + pp->co_linetable, 8);
    uint64_t fp[4] = {code, (uint64_t)(uint32_t)first, name, file};
    /* the stacks' table: a fingerprint's hash, its top bit set (stack ids
     * have it clear) */
    if (!first_sight(hash_stack(fp, 4) | (1ull << 63))) continue;
    uint64_t pos;
    struct mt_py_code* r = (struct mt_py_code*)reserve(sizeof *r, &pos);
    if (!r) return;
    r->h.kind = MT_EV_PYCODE;
    r->h.flags = 0;
    r->h.pid = g_pid;
    r->h.tid = tid_of_thread();
    r->h.ts = 0;
    r->code = code;
    r->first_line = first;
    r->flags = 0;
    r->table_len = 0;
    r->pad = 0;
    if (!py_str(pp, name, r->name, sizeof r->name) || !py_str(pp, file, r->file, sizeof r->file))
      r->flags |= MT_PYC_NONASCII;
    if (!py_ptr_ok(lt)) {
      r->flags |= MT_PYC_UNREADABLE;
    } else {
      uint64_t size;
      memcpy(&size, (const char*)(uintptr_t)(lt + pp->bytes_size), sizeof size);
      if (size > MT_PY_TABLE_LEN) r->flags |= MT_PYC_TABLE_CUT;
      r->table_len = (uint32_t)(size > MT_PY_TABLE_LEN ? MT_PY_TABLE_LEN : size);
      memcpy(r->table, (const char*)(uintptr_t)(lt + pp->bytes_data), r->table_len);
    }
    commit(pos, sizeof *r);
  }
}

/* libunwind's stack from the hook's caller on (ips[0] = ret). Inlined into
 * the hook: buf[0] is inside it. */
static __attribute__((always_inline)) inline int unw_stack(uint64_t* ips, void* ret, uint32_t* flags) {
  void* buf[MT_MAX_FRAMES + 2];
  int got = g_unw_backtrace(buf, MT_MAX_FRAMES + 2), n = 0;
  /* buf[0]: inside the hook; then its caller. Start at the hook's return address. */
  int at = 0;
  while (at < got && at < 3 && buf[at] != ret) at++;
  if (at == got || at == 3) at = got > 1 ? 1 : got;
  for (int i = at; i < got && n < MT_MAX_FRAMES; i++) ips[n++] = (uint64_t)(uintptr_t)buf[i];
  if (got == MT_MAX_FRAMES + 2) *flags |= MT_F_STACK_TRUNCATED;
  return n;
}

/* The loader's CFI rows (agent_unwind.c): libunwind's stack at a few table
 * lookups a frame; a walk they cannot finish is libunwind's (stack_slow),
 * or, without it, the frames they gave, flagged truncated (stack_cut). */
static __attribute__((always_inline)) inline int cfi_stack(uint64_t* ips, void* ret, uintptr_t bp, uint32_t* flags) {
  if (UNLIKELY(!t_stack_hi)) thread_stack_bounds();
  uintptr_t lo = bp > t_stack_lo ? bp : t_stack_lo;
  int n = 0;
  enum mt_cfi_walk_result r = mt_cfi_walk(&t_v->cfi, ips, MT_MAX_FRAMES, &n, (uintptr_t)ret, bp, lo, t_stack_hi);
  if (r == MT_CFI_FULL) *flags |= MT_F_STACK_TRUNCATED;
  if (LIKELY(r != MT_CFI_SLOW)) {
    if (UNLIKELY(t_v->cfi_verify) && g_unw_backtrace) {
      uint64_t u[MT_MAX_FRAMES];
      uint32_t uf = 0;
      int m = unw_stack(u, ret, &uf);
      __atomic_fetch_add(&t_v->hdr->stack_verified, 1, __ATOMIC_RELAXED);
      if (m != n || memcmp(u, ips, sizeof(uint64_t) * (size_t)n) != 0 || (uf ^ *flags) & MT_F_STACK_TRUNCATED)
        __atomic_fetch_add(&t_v->hdr->stack_mismatch, 1, __ATOMIC_RELAXED);
    }
    return n;
  }
  __atomic_fetch_add(&t_v->hdr->stack_slow, 1, __ATOMIC_RELAXED);
  if (g_unw_backtrace) return unw_stack(ips, ret, flags);
  __atomic_fetch_add(&t_v->hdr->stack_cut, 1, __ATOMIC_RELAXED);
  *flags |= MT_F_STACK_TRUNCATED;
  return n;
}

/* The stack of the current hook call, sent if new: its id (0: none). */
static __attribute__((always_inline)) inline uint64_t take_stack(void* ret, uintptr_t bp, uint32_t* flags) {
  uint64_t ips[MT_STACK_SLOTS];
  int n = 0;
  if (t_v->stack_mode == MT_INJ_STACK_CFI) {
    n = cfi_stack(ips, ret, bp, flags);
  } else if (t_v->stack_mode == MT_INJ_STACK_LIBUNWIND && g_unw_backtrace) {
    n = unw_stack(ips, ret, flags);
  } else if (t_v->stack_mode != MT_INJ_STACK_NONE) {
    n = fp_stack(ips, MT_MAX_FRAMES, ret, bp);
    if (n == MT_MAX_FRAMES) *flags |= MT_F_STACK_TRUNCATED;
  }
  if (n == 0) {
    *flags |= MT_F_NO_STACK;
    return 0;
  }
  int py = t_v->py ? py_walk(&t_v->pyp, ips + n, MT_MAX_PY_FRAMES) : 0;
  uint64_t id = hash_stack(ips, n + 2 * py);
  if (first_sight(id)) {
    if (py) py_send_codes(&t_v->pyp, ips + n, py);
    uint32_t len = MT_STACK_BYTES(n + 2 * py);
    uint64_t pos;
    struct mt_stack* s = (struct mt_stack*)reserve(len, &pos);
    if (s) {
      s->h.kind = MT_EV_STACK;
      s->h.flags = *flags & MT_F_STACK_TRUNCATED;
      s->h.pid = g_pid;
      s->h.tid = tid_of_thread();
      s->h.ts = 0;
      s->stack_id = id;
      s->nr = (uint32_t)n;
      s->py_nr = (uint32_t)py;
      memcpy(s->ips, ips, sizeof(uint64_t) * (size_t)(n + 2 * py));
      commit(pos, len);
    }
  }
  return id;
}

/* One compact record (ring.h's struct mt_inj_rec): as long as its fields
 * need, 32-56 bytes with the record word, against 72 for an mt_event. */
static void emit(uint32_t kind, uint32_t flags, uint64_t addr, uint64_t size, uint64_t old_addr, uint64_t stack_id,
                 uint32_t role) {
  uint32_t len = old_addr ? MT_INJ_REC_REALLOC_BYTES
                 : (size | stack_id) || kind != MT_EV_FREE ? MT_INJ_REC_ALLOC_BYTES
                                                           : MT_INJ_REC_FREE_BYTES;
  uint64_t pos;
  struct mt_inj_rec* e = (struct mt_inj_rec*)reserve(len, &pos);
  if (!e) return;
  e->w = MT_INJ_COMPACT | (flags & 0x7fff) << 16 | (role & 0xff) << 8 | (kind & 0xff);
  e->tid = tid_of_thread();
  e->ts = now_ts();
  e->addr = addr;
  if (len >= MT_INJ_REC_ALLOC_BYTES) {
    e->size = size;
    e->stack_id = stack_id;
    if (len >= MT_INJ_REC_REALLOC_BYTES) e->old_addr = old_addr;
  }
  commit(pos, len);
}

/* A call made while a fork is under way: in the child, before the agent's
 * own child handler has switched the hooks off (another library's atfork
 * child handler registered before the agent, which runs first). The child
 * would write into the parent's ring under the parent's pid (a block the
 * parent never frees: a false leak), so the call goes straight to the
 * allocator; its entries are still patched, so the child's uprobes do not
 * see it either: counted in the shared header (the loader's DROPPED
 * inject_fork_child_calls). getpid() (a system call) only while a fork is
 * under way. */
static __attribute__((noinline)) int in_fork_child(struct view* v) {
  if ((uint32_t)getpid() == g_pid) return 0;
  __atomic_add_fetch(&v->hdr->fork_child_calls, 1, __ATOMIC_RELAXED);
  return 1;
}

/* Whether this call is recorded: the ring is there and wanted, and the
 * thread is not inside a hook already. Sets the flag. */
static inline int enter(void) {
  if (UNLIKELY(t_in_hook)) return 0;
  struct view* v = __atomic_load_n(&g_view, __ATOMIC_ACQUIRE);
  if (UNLIKELY(!v || v->off)) return 0;
  if (UNLIKELY(__atomic_load_n(&v->hdr->state, __ATOMIC_RELAXED) != MT_INJ_ATTACHED)) return 0;
  if (UNLIKELY(__atomic_load_n(&g_forking, __ATOMIC_RELAXED)) && in_fork_child(v)) return 0;
  if (UNLIKELY(++t_count % MT_INJ_HEARTBEAT_EVERY == 0) && !loader_alive(v)) return 0;
  t_v = v;
  t_in_hook = 1;
  return 1;
}
static inline void leave(void) { t_in_hook = 0; }

/* ---- --sample-bytes (issue 34, ring.h sample_bytes): a Poisson byte
 * sampler per thread, as tcmalloc's. Each thread counts down the bytes to
 * its next sample (t_left), drawn from an exponential distribution of
 * mean g_sample; an allocation that takes the count to 0 or below is
 * sampled (probability 1 - exp(-size / g_sample): the loader's weight is
 * its inverse) and the next distance drawn (memoryless: from the block's
 * end). An unsampled allocation costs the subtraction. Sampled blocks are
 * marked in g_sbits, counters per address hash; a free whose counter is 0
 * calls straight through, without a record and without a table lookup; a
 * non-zero one is recorded (an unsampled block sharing the bucket: the
 * model finds no block, unknown_frees) and takes the counter down. */
static uint64_t g_sample; /* 0: every call recorded */
#define SBITS_LOG 20
static uint16_t g_sbits[1u << SBITS_LOG];
/* The sum of each 128 buckets' counters (16 KiB: in the L1 cache, where
 * g_sbits' 2 MiB are not): a free looks at g_sbits only when its group
 * holds a sampled block. One load of g_sbits per free was 90% of hook_free
 * (a cache miss), ~12% of W1's time at --sample-bytes 524288 (perf). A
 * group's sum at 0xffff stays (its frees always look further). */
#define SGROUP_LOG 13
static uint16_t g_sgroups[1u << SGROUP_LOG];
static TLS int64_t t_left;
static TLS uint64_t t_rng;
static TLS int t_sinit;

static inline uint32_t sbucket(uintptr_t a) { return (uint32_t)(((uint64_t)(a >> 4) * 0x9e3779b97f4a7c15ull) >> (64 - SBITS_LOG)); }

/* ln(u), u in (0, 1]: exponent and an atanh series on the mantissa (no libm
 * in the agent; ~1e-7 relative, plenty for a sampling distance). */
static double ln_unit(double u) {
  union { double d; uint64_t b; } x = {u};
  int e = (int)((x.b >> 52) & 0x7ff) - 1023;
  x.b = (x.b & ((1ull << 52) - 1)) | (1023ull << 52); /* m in [1, 2) */
  double m = x.d;
  if (m > 1.4142135623730951) {
    m *= 0.5;
    e++;
  }
  double t = (m - 1) / (m + 1), t2 = t * t;
  double s = t * (2 + t2 * (2.0 / 3 + t2 * (2.0 / 5 + t2 * (2.0 / 7 + t2 * (2.0 / 9 + t2 * (2.0 / 11))))));
  return e * 0.6931471805599453 + s;
}

static int64_t next_gap(void) {
  if (UNLIKELY(!t_rng)) t_rng = (now_ns() * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)tid_of_thread() << 32) ^ (uintptr_t)&t_rng;
  /* xorshift64* */
  t_rng ^= t_rng >> 12;
  t_rng ^= t_rng << 25;
  t_rng ^= t_rng >> 27;
  uint64_t r = t_rng * 0x2545f4914f6cdd1dull;
  double u = (double)((r >> 11) + 1) * (1.0 / 9007199254740992.0); /* (0, 1] */
  double g = -ln_unit(u) * (double)g_sample;
  return g >= 9.0e18 ? INT64_MAX : (int64_t)g + 1;
}

static __attribute__((noinline)) int sample_hit(uint64_t size) {
  if (UNLIKELY(!t_sinit)) { /* the thread's first distance (t_left started at 0) */
    t_sinit = 1;
    t_left = next_gap() - (int64_t)size;
    if (t_left > 0) return 0;
  }
  t_left = next_gap();
  return 1;
}

/* Whether an allocation of size bytes is recorded. */
static inline int sampled(uint64_t size) {
  if (LIKELY(!__atomic_load_n(&g_sample, __ATOMIC_RELAXED))) return 1;
  if (LIKELY((t_left -= (int64_t)size) > 0)) return 0;
  return sample_hit(size);
}
static inline void mark_sampled(uint64_t p) {
  if (g_sample && p) {
    uint32_t b = sbucket((uintptr_t)p);
    uint16_t* c = &g_sbits[b];
    if (__atomic_load_n(c, __ATOMIC_RELAXED) == 0xffff) return;
    /* the group first: a group at 0 never hides a bucket above 0 */
    uint16_t* g = &g_sgroups[b >> (SBITS_LOG - SGROUP_LOG)];
    if (__atomic_load_n(g, __ATOMIC_RELAXED) != 0xffff) __atomic_fetch_add(g, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(c, 1, __ATOMIC_RELAXED);
  }
}
/* Whether a free of p is recorded: every one unsampled, else p's bucket
 * holds a sampled block (taken down, and its group). */
static inline int free_recorded(uint64_t p) {
  if (LIKELY(!__atomic_load_n(&g_sample, __ATOMIC_RELAXED))) return 1;
  uint32_t b = sbucket((uintptr_t)p);
  uint16_t* g = &g_sgroups[b >> (SBITS_LOG - SGROUP_LOG)];
  if (LIKELY(__atomic_load_n(g, __ATOMIC_RELAXED) == 0)) return 0;
  uint16_t* c = &g_sbits[b];
  uint16_t n = __atomic_load_n(c, __ATOMIC_RELAXED);
  if (LIKELY(n == 0)) return 0;
  if (n != 0xffff) {
    __atomic_fetch_sub(c, 1, __ATOMIC_RELAXED);
    if (__atomic_load_n(g, __ATOMIC_RELAXED) != 0xffff) __atomic_fetch_sub(g, 1, __ATOMIC_RELAXED);
  }
  return 1;
}

static uint64_t mul_sat(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

#define RET __builtin_return_address(0)
#define BP ((uintptr_t)__builtin_frame_address(0))

/* ---- hooks. noinline: each has its own frame (the stack starts at its
 * return address). */

static __attribute__((noinline)) void* hook_malloc(size_t size) {
  if (!sampled(size) || !enter()) return real.malloc(size);
  uint32_t flags = 0;
  uint64_t sid = take_stack(RET, BP, &flags);
  void* p = real.malloc(size);
  mark_sampled((uintptr_t)p);
  emit(p ? MT_EV_ALLOC : MT_EV_ALLOC_FAIL, flags, (uintptr_t)p, size, 0, sid, MT_ROLE_MALLOC);
  leave();
  return p;
}

static __attribute__((noinline)) void hook_free(void* ptr) {
  if (!ptr || !free_recorded((uintptr_t)ptr) || !enter()) {
    real.free(ptr);
    return;
  }
  /* The record before the block goes back: a thread that gets the address
   * next writes its record after this one. */
  emit(MT_EV_FREE, 0, (uintptr_t)ptr, 0, 0, 0, MT_ROLE_FREE);
  real.free(ptr);
  leave();
}

static __attribute__((noinline)) void* hook_calloc(size_t n, size_t size) {
  if (!sampled(mul_sat(n, size)) || !enter()) return real.calloc(n, size);
  uint32_t flags = 0;
  uint64_t sid = take_stack(RET, BP, &flags);
  void* p = real.calloc(n, size);
  mark_sampled((uintptr_t)p);
  emit(p ? MT_EV_ALLOC : MT_EV_ALLOC_FAIL, flags, (uintptr_t)p, mul_sat(n, size), 0, sid, MT_ROLE_CALLOC);
  leave();
  return p;
}

/* realloc(p, n) as the BPF path records it: p dies at entry; at return the
 * new block, or p revived (MT_EV_REALLOC_FAIL) if realloc failed with n > 0. */
static void realloc_record(void* old, void* p, uint64_t size, uint32_t flags, uint64_t sid, uint32_t role) {
  if (old && !p) {
    if (size) emit(MT_EV_REALLOC_FAIL, flags, (uintptr_t)old, size, 0, sid, role);
    return;
  }
  emit(p ? MT_EV_ALLOC : MT_EV_ALLOC_FAIL, flags, (uintptr_t)p, size, (uintptr_t)old, sid, role);
}

/* realloc_record under --sample-bytes: the old block recorded (rec_old: it
 * was sampled) or not, the new one sampled (rec_new) or not. */
static void realloc_sampled(void* old, int rec_new, void* p, uint64_t size, uint32_t flags, uint64_t sid, uint32_t role) {
  if (rec_new) {
    realloc_record(old, p, size, flags, sid, role);
    mark_sampled((uintptr_t)(p ? p : size ? old : NULL)); /* a failed realloc's old block lives on */
  } else if (old && !p && size) {
    emit(MT_EV_REALLOC_FAIL, flags, (uintptr_t)old, size, 0, sid, role); /* old lives on */
    mark_sampled((uintptr_t)old);
  }
}

static __attribute__((noinline)) void* hook_realloc(void* old, size_t size) {
  int rec_old = old && free_recorded((uintptr_t)old), rec_new = sampled(size);
  if (!(rec_old || rec_new) || !enter()) return real.realloc(old, size);
  uint32_t flags = 0;
  uint64_t sid = take_stack(RET, BP, &flags);
  if (rec_old) emit(MT_EV_FREE, flags, (uintptr_t)old, 0, 0, sid, MT_ROLE_REALLOC);
  void* p = real.realloc(old, size);
  realloc_sampled(rec_old ? old : NULL, rec_new, p, size, flags, sid, MT_ROLE_REALLOC);
  leave();
  return p;
}

static __attribute__((noinline)) void* hook_reallocarray(void* old, size_t n, size_t size) {
  int rec_old = old && free_recorded((uintptr_t)old), rec_new = sampled(mul_sat(n, size));
  if (!(rec_old || rec_new) || !enter()) return real.reallocarray(old, n, size);
  uint32_t flags = 0;
  uint64_t sid = take_stack(RET, BP, &flags);
  if (rec_old) emit(MT_EV_FREE, flags, (uintptr_t)old, 0, 0, sid, MT_ROLE_REALLOCARRAY);
  void* p = real.reallocarray(old, n, size);
  realloc_sampled(rec_old ? old : NULL, rec_new, p, mul_sat(n, size), flags, sid, MT_ROLE_REALLOCARRAY);
  leave();
  return p;
}

/* Called from inside a C++ aligned operator new: the size the program asked
 * for and MT_F_CXX_NEW, as the BPF path records it (MT_ROLE_ALIGNED_NEW);
 * the mark is taken by the first aligned call in any case. */
static inline uint64_t asked_size(uint64_t size, uint32_t* flags) {
  if (LIKELY(!t_new_pending)) return size;
  t_new_pending = 0;
  *flags |= MT_F_CXX_NEW;
  return t_new_size;
}

static __attribute__((noinline)) int hook_posix_memalign(void** out, size_t align, size_t size) {
  if (!sampled(t_new_pending ? t_new_size : size) || !enter()) {
    t_new_pending = 0;
    return real.posix_memalign(out, align, size);
  }
  uint32_t flags = 0;
  uint64_t sid = take_stack(RET, BP, &flags);
  int r = real.posix_memalign(out, align, size);
  void* p = r == 0 ? *out : NULL;
  uint64_t asked = asked_size(size, &flags);
  mark_sampled((uintptr_t)p);
  emit(p ? MT_EV_ALLOC : MT_EV_ALLOC_FAIL, flags, (uintptr_t)p, asked, 0, sid, MT_ROLE_POSIX_MEMALIGN);
  leave();
  return r;
}

#define ALIGNED_HOOK(name, role)                                                              \
  static __attribute__((noinline)) void* hook_##name(size_t align, size_t size) {             \
    if (!sampled(t_new_pending ? t_new_size : size) || !enter()) {                            \
      t_new_pending = 0;                                                                      \
      return real.name(align, size);                                                          \
    }                                                                                         \
    uint32_t flags = 0;                                                                       \
    uint64_t sid = take_stack(RET, BP, &flags);                                               \
    void* p = real.name(align, size);                                                         \
    uint64_t asked = asked_size(size, &flags);                                                \
    mark_sampled((uintptr_t)p);                                                               \
    emit(p ? MT_EV_ALLOC : MT_EV_ALLOC_FAIL, flags, (uintptr_t)p, asked, 0, sid, role);       \
    leave();                                                                                  \
    return p;                                                                                 \
  }
ALIGNED_HOOK(aligned_alloc, MT_ROLE_ALIGNED_ALLOC)
ALIGNED_HOOK(memalign, MT_ROLE_MEMALIGN)

#define PAGE_HOOK(name, role)                                                                 \
  static __attribute__((noinline)) void* hook_##name(size_t size) {                           \
    if (!sampled(size) || !enter()) return real.name(size);                                        \
    uint32_t flags = 0;                                                                       \
    uint64_t sid = take_stack(RET, BP, &flags);                                               \
    void* p = real.name(size);                                                                     \
    mark_sampled((uintptr_t)p);                                                                    \
    emit(p ? MT_EV_ALLOC : MT_EV_ALLOC_FAIL, flags, (uintptr_t)p, size, 0, sid, role);        \
    leave();                                                                                  \
    return p;                                                                                 \
  }
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
PAGE_HOOK(valloc, MT_ROLE_VALLOC)
PAGE_HOOK(pvalloc, MT_ROLE_PVALLOC)
#pragma GCC diagnostic pop

/* C++ aligned operator new: not recorded itself (its aligned_alloc is,
 * through libstdc++'s GOT slot); it leaves the size asked for to that call.
 * No frame of ours needs cleaning if it throws (bad_alloc goes through this
 * frame: the agent is built with unwind tables). */
#define NEW_HOOK(name)                                                          \
  static __attribute__((noinline)) void* hook_##name(size_t size, size_t al) { \
    t_new_size = size;                                                          \
    t_new_pending = 1;                                                          \
    void* p = real.name(size, al);                                              \
    t_new_pending = 0;                                                          \
    return p;                                                                   \
  }
#define NEW_NT_HOOK(name)                                                                       \
  static __attribute__((noinline)) void* hook_##name(size_t size, size_t al, const void* nt) { \
    t_new_size = size;                                                                          \
    t_new_pending = 1;                                                                          \
    void* p = real.name(size, al, nt);                                                          \
    t_new_pending = 0;                                                                          \
    return p;                                                                                   \
  }
NEW_HOOK(new_al)
NEW_HOOK(new_arr_al)
NEW_NT_HOOK(new_al_nt)
NEW_NT_HOOK(new_arr_al_nt)

/* ---- the allocator's other entries (ring.h: fns, a non-glibc allocator):
 * C++ operator new/delete of jemalloc, tcmalloc, mimalloc (sized and
 * aligned deletes, nothrow news), jemalloc's mallocx/rallocx/sdallocx/
 * dallocx, and the prefixed malloc family's second names. One hook per
 * given function (a slot): it passes the four argument registers through
 * (every one of them takes at most four integer arguments) and records by
 * its role: malloc-like (the size first: new, aligned new, mallocx),
 * realloc-like (ptr, size: rallocx), free-like (the pointer first: delete,
 * sized delete, sdallocx, dallocx). The outermost hook records: an entry
 * reached from inside another (jemalloc's delete jumps to free, rallocx to
 * realloc) calls straight through (t_in_hook). A C++ exception (operator
 * new's bad_alloc) goes through the slot's frame: the cleanup clears the
 * flag (-fexceptions). */
typedef uint64_t (*fn4_t)(uint64_t, uint64_t, uint64_t, uint64_t);
static void* g_slot_real[MT_INJ_FN_MAX];
static uint32_t g_slot_role[MT_INJ_FN_MAX];

static void hook_unwound(int* on) {
  if (*on) leave();
}

static __attribute__((always_inline)) inline uint64_t slot_call(uint32_t n, uint64_t a, uint64_t b, uint64_t c,
                                                                uint64_t d, void* ret, uintptr_t bp) {
  fn4_t f = (fn4_t)__atomic_load_n(&g_slot_real[n], __ATOMIC_ACQUIRE);
  uint32_t role = g_slot_role[n];
  if (role == MT_ROLE_FREE) {
    if (!a || !free_recorded(a) || !enter()) return f(a, b, c, d);
    emit(MT_EV_FREE, 0, a, 0, 0, 0, MT_ROLE_FREE);
    int on __attribute__((cleanup(hook_unwound))) = 1;
    return f(a, b, c, d);
  }
  int rec_old = role == MT_ROLE_REALLOC && a && free_recorded(a), rec_new = sampled(role == MT_ROLE_REALLOC ? b : a);
  if (!(rec_old || rec_new) || !enter()) return f(a, b, c, d);
  int on __attribute__((cleanup(hook_unwound))) = 1;
  uint32_t flags = 0;
  uint64_t sid = take_stack(ret, bp, &flags);
  if (role == MT_ROLE_REALLOC) {
    if (rec_old) emit(MT_EV_FREE, flags, a, 0, 0, sid, role);
    uint64_t p = f(a, b, c, d);
    realloc_sampled(rec_old ? (void*)(uintptr_t)a : NULL, rec_new, (void*)(uintptr_t)p, b, flags, sid, role);
    return p;
  }
  uint64_t p = f(a, b, c, d);
  mark_sampled(p);
  emit(p ? MT_EV_ALLOC : MT_EV_ALLOC_FAIL, flags, p, a, 0, sid, role);
  return p;
}

#define SLOT(n)                                                                                \
  static __attribute__((noinline)) uint64_t slot_##n(uint64_t a, uint64_t b, uint64_t c, uint64_t d) { \
    return slot_call(n, a, b, c, d, RET, BP);                                                  \
  }
SLOT(0) SLOT(1) SLOT(2) SLOT(3) SLOT(4) SLOT(5) SLOT(6) SLOT(7)
SLOT(8) SLOT(9) SLOT(10) SLOT(11) SLOT(12) SLOT(13) SLOT(14) SLOT(15)
SLOT(16) SLOT(17) SLOT(18) SLOT(19) SLOT(20) SLOT(21) SLOT(22) SLOT(23)
SLOT(24) SLOT(25) SLOT(26) SLOT(27) SLOT(28) SLOT(29) SLOT(30) SLOT(31)
SLOT(32) SLOT(33) SLOT(34) SLOT(35) SLOT(36) SLOT(37) SLOT(38) SLOT(39)
_Static_assert(MT_INJ_FN_MAX == 40, "one slot hook per given function");
static void* const g_slot_hooks[MT_INJ_FN_MAX] = {
    (void*)slot_0, (void*)slot_1, (void*)slot_2, (void*)slot_3, (void*)slot_4, (void*)slot_5, (void*)slot_6, (void*)slot_7,
    (void*)slot_8, (void*)slot_9, (void*)slot_10, (void*)slot_11, (void*)slot_12, (void*)slot_13, (void*)slot_14, (void*)slot_15,
    (void*)slot_16, (void*)slot_17, (void*)slot_18, (void*)slot_19, (void*)slot_20, (void*)slot_21, (void*)slot_22, (void*)slot_23,
    (void*)slot_24, (void*)slot_25, (void*)slot_26, (void*)slot_27, (void*)slot_28, (void*)slot_29, (void*)slot_30, (void*)slot_31,
    (void*)slot_32, (void*)slot_33, (void*)slot_34, (void*)slot_35, (void*)slot_36, (void*)slot_37, (void*)slot_38, (void*)slot_39,
};

static void rewrite_all(void);

/* Objects a dlopen brings get their slots rewritten too. */
static void* hook_dlopen(const char* file, int mode) {
  void* h = real.dlopen(file, mode);
  struct view* v = __atomic_load_n(&g_view, __ATOMIC_ACQUIRE);
  if (h && v && !v->off) rewrite_all();
  return h;
}

/* ---- GOT rewriting. */

struct hook {
  const char* name;
  void* fn;
};
static const struct hook g_hooks[] = {
    {"malloc", (void*)hook_malloc},
    {"free", (void*)hook_free},
    {"calloc", (void*)hook_calloc},
    {"realloc", (void*)hook_realloc},
    {"reallocarray", (void*)hook_reallocarray},
    {"posix_memalign", (void*)hook_posix_memalign},
    {"aligned_alloc", (void*)hook_aligned_alloc},
    {"memalign", (void*)hook_memalign},
    {"valloc", (void*)hook_valloc},
    {"pvalloc", (void*)hook_pvalloc},
    {"dlopen", (void*)hook_dlopen},
    {"_ZnwmSt11align_val_t", (void*)hook_new_al},
    {"_ZnamSt11align_val_t", (void*)hook_new_arr_al},
    {"_ZnwmSt11align_val_tRKSt9nothrow_t", (void*)hook_new_al_nt},
    {"_ZnamSt11align_val_tRKSt9nothrow_t", (void*)hook_new_arr_al_nt},
};

/* The loader's list of the allocator's functions (ring.h fns), copied at
 * the first attach: g_fn_count 0 when the allocator is glibc's. */
static uint32_t g_fn_count;
static char g_fn_name[MT_INJ_FN_MAX][48];
static uint32_t g_fn_role[MT_INJ_FN_MAX]; /* with MT_INJ_FN_PRIMARY */
static int g_fn_plain; /* the allocator's malloc is named "malloc": libstdc++'s aligned new calls it */

static void** real_of_role(uint32_t role) {
  switch (role) {
    case MT_ROLE_MALLOC: return (void**)&real.malloc;
    case MT_ROLE_CALLOC: return (void**)&real.calloc;
    case MT_ROLE_REALLOC: return (void**)&real.realloc;
    case MT_ROLE_REALLOCARRAY: return (void**)&real.reallocarray;
    case MT_ROLE_FREE: return (void**)&real.free;
    case MT_ROLE_POSIX_MEMALIGN: return (void**)&real.posix_memalign;
    case MT_ROLE_ALIGNED_ALLOC: return (void**)&real.aligned_alloc;
    case MT_ROLE_MEMALIGN: return (void**)&real.memalign;
    case MT_ROLE_VALLOC: return (void**)&real.valloc;
    case MT_ROLE_PVALLOC: return (void**)&real.pvalloc;
    default: return NULL;
  }
}

static const void* named_hook_of_role(uint32_t role) {
  static const char* const names[] = {"malloc",         "calloc",        "realloc",  "reallocarray", "free",
                                      "posix_memalign", "aligned_alloc", "memalign", "valloc",       "pvalloc"};
  if (role >= sizeof names / sizeof names[0]) return NULL;
  for (size_t i = 0; i < sizeof g_hooks / sizeof g_hooks[0]; i++)
    if (strcmp(names[role], g_hooks[i].name) == 0) return g_hooks[i].fn;
  return NULL;
}

static const void* hook_for(const char* name) {
  if (g_fn_count) {
    /* A given allocator: its functions by their exact names (je_malloc
     * when prefixed: the plain names are libc's then, left alone). */
    for (uint32_t i = 0; i < g_fn_count; i++) {
      if (strcmp(name, g_fn_name[i]) != 0) continue;
      if (g_fn_role[i] & MT_INJ_FN_PRIMARY) {
        void** r = real_of_role(g_fn_role[i] & 0xff);
        return r && *r ? named_hook_of_role(g_fn_role[i] & 0xff) : NULL;
      }
      return g_slot_real[i] ? g_slot_hooks[i] : NULL;
    }
    if (strcmp(name, "dlopen") == 0) return (const void*)hook_dlopen;
    /* libstdc++'s aligned operator new, which calls the allocator's
     * aligned_alloc by its plain name (not when the allocator defines its
     * own: found above). */
    if (!g_fn_plain || name[0] != '_') return NULL;
  }
  for (size_t i = 0; i < sizeof g_hooks / sizeof g_hooks[0]; i++)
    if (strcmp(name, g_hooks[i].name) == 0) {
      /* operator new's hooks only once the C++ runtime is there to call. */
      if (name[0] == '_') {
        int arr = name[3] == 'a', nt = strchr(name, 'R') != NULL;
        void** r = nt ? (arr ? (void**)&real.new_arr_al_nt : (void**)&real.new_al_nt)
                      : (arr ? (void**)&real.new_arr_al : (void**)&real.new_al);
        if (!*r) {
          /* The process's definition (libstdc++'s), found from the global
           * scope (RTLD_NEXT would search only the agent's own
           * dependencies); not a non-PIE program's PLT entry, whose GOT
           * slot is the one rewritten (dladdr names only definitions). */
          void* def = dlsym(RTLD_DEFAULT, name);
          Dl_info di;
          if (def && dladdr(def, &di) && di.dli_sname && strcmp(di.dli_sname, name) == 0 && di.dli_saddr == def)
            *r = def;
        }
        if (!*r) return NULL;
      }
      return g_hooks[i].fn;
    }
  return NULL;
}

static int skip_object(const struct dl_phdr_info* info) {
  const char* name = info->dlpi_name ? info->dlpi_name : "";
  const char* base = strrchr(name, '/');
  base = base ? base + 1 : name;
  if (strncmp(base, "ld-linux", 8) == 0 ||
      strncmp(base, "linux-vdso", 10) == 0 || strstr(base, "libmemtrace_agent") != NULL)
    return 1;
  /* Ourselves, whatever our file is called: an object holding this code. */
  uintptr_t self = (uintptr_t)&hook_malloc;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr)* ph = &info->dlpi_phdr[i];
    if (ph->p_type != PT_LOAD) continue;
    uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
    if (self >= lo && self < lo + ph->p_memsz) return 1;
  }
  return 0;
}

/* d_ptr values: ld.so relocates most of them in place; a value below the
 * load bias has not been. */
static uintptr_t dyn_ptr(const struct dl_phdr_info* info, uintptr_t v) {
  return v < info->dlpi_addr ? v + info->dlpi_addr : v;
}

struct rewrite_stats {
  uint32_t slots, objects;
};

static void write_slot(const struct dl_phdr_info* info, uintptr_t slot, const void* fn) {
  if (*(void* const*)slot == fn) return;
  uintptr_t relro_lo = 0, relro_hi = 0;
  for (int i = 0; i < info->dlpi_phnum; i++)
    if (info->dlpi_phdr[i].p_type == PT_GNU_RELRO) {
      relro_lo = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
      relro_hi = relro_lo + info->dlpi_phdr[i].p_memsz;
    }
  long page = sysconf(_SC_PAGESIZE);
  uintptr_t pg = slot & ~(uintptr_t)(page - 1);
  int ro = slot >= relro_lo && slot < relro_hi;
  if (ro && mprotect((void*)pg, (size_t)page, PROT_READ | PROT_WRITE) != 0) return;
  __atomic_store_n((void**)slot, (void*)fn, __ATOMIC_RELEASE);
  if (ro) mprotect((void*)pg, (size_t)page, PROT_READ);
}

#if defined(__aarch64__)
#define MT_R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define MT_R_GLOB_DAT R_AARCH64_GLOB_DAT
#else
#define MT_R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define MT_R_GLOB_DAT R_X86_64_GLOB_DAT
#endif

static void rewrite_relocs(const struct dl_phdr_info* info, const ElfW(Rela) * rel, size_t bytes,
                           const ElfW(Sym) * symtab, const char* strtab, uint32_t* slots) {
  for (size_t i = 0; i < bytes / sizeof(ElfW(Rela)); i++) {
    uint32_t type = ELF64_R_TYPE(rel[i].r_info), sym = ELF64_R_SYM(rel[i].r_info);
    if ((type != MT_R_JUMP_SLOT && type != MT_R_GLOB_DAT) || sym == 0) continue;
    const void* fn = hook_for(strtab + symtab[sym].st_name);
    if (!fn) continue;
    write_slot(info, info->dlpi_addr + rel[i].r_offset, fn);
    (*slots)++;
  }
}

static int rewrite_object(struct dl_phdr_info* info, size_t size, void* data) {
  struct rewrite_stats* st = (struct rewrite_stats*)data;
  if (skip_object(info)) return 0;
  const ElfW(Dyn)* dyn = NULL;
  for (int i = 0; i < info->dlpi_phnum; i++)
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn)*)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
  if (!dyn) return 0;
  const ElfW(Sym)* symtab = NULL;
  const char* strtab = NULL;
  const ElfW(Rela)*jmprel = NULL, *rela = NULL;
  size_t jmprel_bytes = 0, rela_bytes = 0;
  for (; dyn->d_tag != DT_NULL; dyn++) {
    switch (dyn->d_tag) {
      case DT_SYMTAB: symtab = (const ElfW(Sym)*)dyn_ptr(info, dyn->d_un.d_ptr); break;
      case DT_STRTAB: strtab = (const char*)dyn_ptr(info, dyn->d_un.d_ptr); break;
      case DT_JMPREL: jmprel = (const ElfW(Rela)*)dyn_ptr(info, dyn->d_un.d_ptr); break;
      case DT_PLTRELSZ: jmprel_bytes = dyn->d_un.d_val; break;
      case DT_RELA: rela = (const ElfW(Rela)*)dyn_ptr(info, dyn->d_un.d_ptr); break;
      case DT_RELASZ: rela_bytes = dyn->d_un.d_val; break;
      default: break;
    }
  }
  if (!symtab || !strtab) return 0;
  uint32_t before = st->slots;
  if (jmprel) rewrite_relocs(info, jmprel, jmprel_bytes, symtab, strtab, &st->slots);
  if (rela) rewrite_relocs(info, rela, rela_bytes, symtab, strtab, &st->slots);
  if (st->slots != before) st->objects++;
  return 0;
}

static pthread_mutex_t g_rewrite_lock = PTHREAD_MUTEX_INITIALIZER;

static void rewrite_all(void) {
  struct rewrite_stats st = {0, 0};
  int was = t_in_hook;
  t_in_hook = 1;
  pthread_mutex_lock(&g_rewrite_lock);
  dl_iterate_phdr(rewrite_object, &st);
  pthread_mutex_unlock(&g_rewrite_lock);
  t_in_hook = was;
  struct view* v = __atomic_load_n(&g_view, __ATOMIC_ACQUIRE);
  if (v) {
    __atomic_store_n(&v->hdr->slots_hooked, st.slots, __ATOMIC_RELAXED);
    __atomic_store_n(&v->hdr->objects_hooked, st.objects, __ATOMIC_RELAXED);
  }
}

/* ---- entry trampolines (x86-64): the loader patches the allocator's own
 * entries (ring.h: entries) to jump to the hooks, so that calls that do not
 * go through a GOT slot reach them too (a dlsym pointer to malloc, ld.so's
 * own pointer, a dlopen'd library's constructor, libc's internal calls);
 * the hooks then call the original through the stub the loader wrote, which
 * the loader stores in real.X. Here: the list of entries and the area for
 * the stubs, near libc (the stubs' relocated rip-relative operands and the
 * entry's rel32 jmp reach +-2 GiB). */

#if defined(__x86_64__)
struct entry {
  const char* name;
  void** real;     /* &real.X: the loader stores the stub there */
  void* hook;
  void* fn;        /* libc's function, as first resolved (real.X becomes the stub) */
  uint8_t orig[32]; /* the loader's: the bytes its jmp replaced, */
  uint8_t orig_len; /* how many (0: not patched), */
  uint8_t patched[32]; /* and those bytes as it left them (its jmp in them) */
  uint32_t role;       /* enum mt_role of its hook */
};
static struct entry g_entries[MT_INJ_ENTRY_MAX];
static uint32_t g_entry_count;
static void* g_tramp; /* MT_INJ_TRAMP_BYTES, read+exec; kept for good (stubs live there) */

/* An area within 1 GiB of near, not overlapping anything (MAP_FIXED_NOREPLACE;
 * a kernel before 4.17 takes it as a hint: checked). */
static void* tramp_near(uintptr_t near) {
  const uintptr_t step = 1u << 20, bytes = MT_INJ_TRAMP_BYTES;
  near &= ~(step - 1);
  for (uintptr_t d = step; d < (1ull << 30); d += step) {
    for (int sign = -1; sign <= 1; sign += 2) {
      uintptr_t at = sign < 0 ? near - d : near + d;
      if (sign < 0 && near < d + bytes) continue;
      void* m = mmap((void*)at, bytes, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS | 0x100000 /* MAP_FIXED_NOREPLACE */,
                     -1, 0);
      if (m == MAP_FAILED) continue;
      if ((uintptr_t)m == at) return m;
      munmap(m, bytes);
    }
  }
  return NULL;
}

static void add_entry(const char* name, void** realp, void* hook, uint32_t role) {
  if (!*realp || g_entry_count >= MT_INJ_ENTRY_MAX) return;
  for (uint32_t i = 0; i < g_entry_count; i++)
    if (g_entries[i].real == realp) return;
  struct entry* e = &g_entries[g_entry_count++];
  e->name = name;
  e->real = realp;
  e->hook = hook;
  e->fn = *realp;
  e->role = role;
}

/* A given allocator's name for a role (je_malloc), else the role's. */
static const char* given_name(uint32_t role, const char* plain) {
  for (uint32_t i = 0; i < g_fn_count; i++)
    if ((g_fn_role[i] & MT_INJ_FN_PRIMARY) && (g_fn_role[i] & 0xff) == role) return g_fn_name[i];
  return plain;
}

/* The entries for the loader to patch (those it patched before keep their
 * stub: never patched twice). */
static void list_entries(struct mt_inj_hdr* r) {
  add_entry(given_name(MT_ROLE_MALLOC, "malloc"), (void**)&real.malloc, (void*)hook_malloc, MT_ROLE_MALLOC);
  add_entry(given_name(MT_ROLE_FREE, "free"), (void**)&real.free, (void*)hook_free, MT_ROLE_FREE);
  add_entry(given_name(MT_ROLE_CALLOC, "calloc"), (void**)&real.calloc, (void*)hook_calloc, MT_ROLE_CALLOC);
  add_entry(given_name(MT_ROLE_REALLOC, "realloc"), (void**)&real.realloc, (void*)hook_realloc, MT_ROLE_REALLOC);
  add_entry(given_name(MT_ROLE_REALLOCARRAY, "reallocarray"), (void**)&real.reallocarray, (void*)hook_reallocarray,
            MT_ROLE_REALLOCARRAY);
  add_entry(given_name(MT_ROLE_POSIX_MEMALIGN, "posix_memalign"), (void**)&real.posix_memalign,
            (void*)hook_posix_memalign, MT_ROLE_POSIX_MEMALIGN);
  add_entry(given_name(MT_ROLE_ALIGNED_ALLOC, "aligned_alloc"), (void**)&real.aligned_alloc, (void*)hook_aligned_alloc,
            MT_ROLE_ALIGNED_ALLOC);
  add_entry(given_name(MT_ROLE_MEMALIGN, "memalign"), (void**)&real.memalign, (void*)hook_memalign, MT_ROLE_MEMALIGN);
  add_entry(given_name(MT_ROLE_VALLOC, "valloc"), (void**)&real.valloc, (void*)hook_valloc, MT_ROLE_VALLOC);
  add_entry(given_name(MT_ROLE_PVALLOC, "pvalloc"), (void**)&real.pvalloc, (void*)hook_pvalloc, MT_ROLE_PVALLOC);
  add_entry("_ZnwmSt11align_val_t", (void**)&real.new_al, (void*)hook_new_al, MT_ROLE_ALIGNED_NEW);
  add_entry("_ZnamSt11align_val_t", (void**)&real.new_arr_al, (void*)hook_new_arr_al, MT_ROLE_ALIGNED_NEW);
  add_entry("_ZnwmSt11align_val_tRKSt9nothrow_t", (void**)&real.new_al_nt, (void*)hook_new_al_nt, MT_ROLE_ALIGNED_NEW);
  add_entry("_ZnamSt11align_val_tRKSt9nothrow_t", (void**)&real.new_arr_al_nt, (void*)hook_new_arr_al_nt,
            MT_ROLE_ALIGNED_NEW);
  for (uint32_t i = 0; i < g_fn_count; i++)
    if (!(g_fn_role[i] & MT_INJ_FN_PRIMARY)) add_entry(g_fn_name[i], &g_slot_real[i], g_slot_hooks[i], g_slot_role[i]);
  if (!g_tramp) g_tramp = tramp_near((uintptr_t)g_entries[0].fn);
  r->tramp = (uintptr_t)g_tramp;
  r->entry_count = g_tramp ? g_entry_count : 0;
  for (uint32_t i = 0; i < g_entry_count; i++) {
    struct entry* e = &g_entries[i];
    r->entries[i].fn = (uintptr_t)e->fn;
    r->entries[i].hook = (uintptr_t)e->hook;
    r->entries[i].real_slot = (uintptr_t)e->real;
    r->entries[i].stub = *e->real != e->fn ? (uintptr_t)*e->real : 0;
    r->entries[i].orig_slot = (uintptr_t)e->orig;
    _Static_assert(offsetof(struct entry, orig_len) == offsetof(struct entry, orig) + 32 &&
                       offsetof(struct entry, patched) == offsetof(struct entry, orig) + 33,
                   "orig, orig_len, patched: the 65 bytes the loader writes (ring.h orig_slot)");
    snprintf(r->entries[i].name, sizeof r->entries[i].name, "%s", e->name);
    r->entries[i].role = e->role;
  }
}

/* In a fork's child (one thread: this one, in fork's handlers): the
 * entries as the file has them again, the hooks calling the originals. Its
 * tracer (the BPF path takes a child, stopped before it runs this) may
 * have put uprobes at those entries: a uprobe's int3 over the jmp is kept,
 * so the probe then sits on the original instruction, as it expects. */
static void unpatch_in_child(void) {
  for (uint32_t i = 0; i < g_entry_count; i++) {
    struct entry* e = &g_entries[i];
    uint8_t* p = (uint8_t*)e->fn;
    uint32_t n = e->orig_len;
    if (!n || n > sizeof e->orig) continue;
    /* As the loader left them, but for a uprobe's int3 on any byte (a byte
     * of its jmp is never 0xcc). */
    int ours = 1;
    for (uint32_t k = 0; k < n; k++) ours &= p[k] == e->patched[k] || p[k] == 0xcc;
    if (!ours) continue;
    uintptr_t lo = (uintptr_t)p & ~(uintptr_t)4095, hi = ((uintptr_t)p + n + 4095) & ~(uintptr_t)4095;
    if (mprotect((void*)lo, hi - lo, PROT_READ | PROT_WRITE | PROT_EXEC) != 0) continue;
    for (uint32_t k = 0; k < n; k++)
      if (p[k] != 0xcc) p[k] = e->orig[k];
    mprotect((void*)lo, hi - lo, PROT_READ | PROT_EXEC);
    __builtin___clear_cache((char*)p, (char*)p + n);
    for (uint32_t j = 0; j < g_entry_count; j++)
      if (g_entries[j].fn == e->fn) __atomic_store_n(g_entries[j].real, e->fn, __ATOMIC_RELEASE);
  }
}
#else
static void list_entries(struct mt_inj_hdr* r) { r->entry_count = 0; }
static void unpatch_in_child(void) {}
#endif

/* ---- setup. */

/* The real functions; NULL if they can be found, else why not. */
/* The allocator the loader found (ring.h fns): the role functions'
 * definitions where it says, the others through slots. */
static const char* resolve_given(const struct mt_inj_hdr* r) {
  uint32_t n = r->fn_count < MT_INJ_FN_MAX ? r->fn_count : MT_INJ_FN_MAX;
  for (uint32_t i = 0; i < n; i++) {
    const struct mt_inj_fn* f = &r->fns[i];
    memcpy(g_fn_name[i], f->name, sizeof g_fn_name[i]);
    g_fn_name[i][sizeof g_fn_name[i] - 1] = 0;
    g_fn_role[i] = f->role;
    if (!f->addr) continue;
    uint32_t role = f->role & 0xff;
    if (f->role & MT_INJ_FN_PRIMARY) {
      void** rp = real_of_role(role);
      if (rp && !*rp) *rp = (void*)(uintptr_t)f->addr;
      if (role == MT_ROLE_MALLOC && strcmp(g_fn_name[i], "malloc") == 0) g_fn_plain = 1;
    } else {
      g_slot_role[i] = role == MT_ROLE_FREE ? MT_ROLE_FREE : role == MT_ROLE_REALLOC ? MT_ROLE_REALLOC : MT_ROLE_MALLOC;
      g_slot_real[i] = (void*)(uintptr_t)f->addr;
    }
  }
  *(void**)&real.dlopen = dlsym(RTLD_NEXT, "dlopen");
  if (!real.dlopen) return "dlsym(RTLD_NEXT, dlopen) found nothing";
  if (!real.malloc || !real.free) return "the loader's allocator has no malloc and free";
  g_fn_count = n;
  return NULL;
}

static const char* resolve_real(void) {
#define REAL(n)                                                   \
  do {                                                            \
    *(void**)&real.n = dlsym(RTLD_NEXT, #n);                      \
    if (!real.n) return "dlsym(RTLD_NEXT, " #n ") found nothing"; \
  } while (0)
  REAL(malloc);
  REAL(free);
  REAL(calloc);
  REAL(realloc);
  REAL(reallocarray);
  REAL(posix_memalign);
  REAL(aligned_alloc);
  REAL(memalign);
  REAL(valloc);
  REAL(pvalloc);
  REAL(dlopen);
#undef REAL
  /* The program's malloc must be the one found here (libc's): an allocator
   * defined before it in the global scope (LD_PRELOAD=libjemalloc.so) is
   * not supported yet. A non-PIE program's PLT entry (python3) is not a
   * definition: dladdr names no "malloc" there. */
  static const char* const names[] = {"malloc", "free", "calloc", "realloc"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    void* def = dlsym(RTLD_DEFAULT, names[i]);
    Dl_info di;
    const ElfW(Sym)* sym = NULL;
    if (def && def != dlsym(RTLD_NEXT, names[i]) && dladdr1(def, &di, (void**)&sym, RTLD_DL_SYMENT) && sym &&
        di.dli_sname && strcmp(di.dli_sname, names[i]) == 0 && di.dli_saddr == def && sym->st_shndx != SHN_UNDEF)
      return "the program's allocator is not libc's (preloaded allocator): not supported by --inject yet";
  }
  return NULL;
}

/* Prepare handlers run in the reverse order of registration: the agent's,
 * registered last, first; its parent and child handlers last. */
static void before_fork(void) { __atomic_add_fetch(&g_forking, 1, __ATOMIC_SEQ_CST); }
static void after_fork_parent(void) { __atomic_sub_fetch(&g_forking, 1, __ATOMIC_SEQ_CST); }

static void after_fork_child(void) {
  struct view* v = __atomic_load_n(&g_view, __ATOMIC_ACQUIRE);
  if (v) v->off = 1;
  unpatch_in_child();
}

static void agent_failed(struct mt_inj_hdr* r, const char* why) {
  snprintf(r->agent_error, sizeof r->agent_error, "%s", why);
  __atomic_store_n(&r->agent_state, MT_INJ_AGENT_FAILED, __ATOMIC_RELEASE);
}

static pthread_mutex_t g_attach_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_real_ok, g_atfork_ok;

#if defined(__x86_64__)
/* The executable segment holding address io[0]: [io[0], io[1]). */
static int own_text(struct dl_phdr_info* info, size_t size, void* data) {
  uint64_t* io = (uint64_t*)data;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr)* ph = &info->dlpi_phdr[i];
    uint64_t lo = info->dlpi_addr + ph->p_vaddr;
    if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X) && io[0] >= lo && io[0] < lo + ph->p_memsz) {
      io[0] = lo;
      io[1] = lo + ph->p_memsz;
      return 1;
    }
  }
  return 0;
}
#endif

/* MT_INJ_STACK_CFI: the loader's rows in the ring's file (ring.h cfi_off),
 * and a memo of this session's own (a later attach brings rows of the
 * process's mappings then). 0: none usable. */
static int cfi_view(struct view* v, const struct mt_inj_hdr* r, uint64_t file_bytes) {
#if defined(__x86_64__)
  uint64_t mods = r->cfi_mods, rows = r->cfi_rows, off = r->cfi_off;
  uint64_t need = mods * sizeof(struct mt_inj_cfi_mod) + rows * sizeof(struct mt_unwind_row);
  if (!off || !mods || off < r->hdr_bytes + r->data_bytes || off > file_bytes || need > file_bytes - off || (off & 7))
    return 0;
  void* memo = mmap(NULL, mt_cfi_memo_bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memo == MAP_FAILED) return 0;
  const char* base = (const char*)r + off;
  v->cfi.mods = (const struct mt_inj_cfi_mod*)base;
  v->cfi.nmods = (uint32_t)mods;
  v->cfi.rows = (const struct mt_unwind_row*)(base + mods * sizeof(struct mt_inj_cfi_mod));
  v->cfi.nrows = (uint32_t)rows;
  v->cfi.memo = (uint64_t*)memo;
  uint64_t self[2] = {(uintptr_t)&hook_malloc, 0};
  dl_iterate_phdr(own_text, self);
  v->cfi.self_lo = self[0];
  v->cfi.self_hi = self[1];
  return 1;
#else
  (void)v;
  (void)r;
  (void)file_bytes;
  return 0;
#endif
}

/* Maps this process's ring (the loader made it: MT_INJ_PATH_FMT) and hooks
 * the process: 0. 1: no ring for us (loaded by something else), 2: the
 * ring says why not (agent_error). The constructor's work, and a later
 * --inject's (memtrace_agent_attach): the GOT slots stay rewritten between
 * sessions (the hooks call straight through while none records). */
static int attach_ring(void) {
  char path[64];
  snprintf(path, sizeof path, MT_INJ_PATH_FMT, (int)getpid());
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return 1; /* not for us: loaded by something else */
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < MT_INJ_HDR_BYTES) {
    close(fd);
    return 1;
  }
  /* MAP_POPULATE: the ring's pages (allocated by the loader) mapped now,
   * while the loader holds the process stopped, not one fault at a time
   * in the first lap of the hooks' writes. */
  void* m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return 1;
  struct mt_inj_hdr* r = (struct mt_inj_hdr*)m;
  if (r->magic != MT_INJ_MAGIC || r->version != MT_INJ_VERSION || r->pid != (uint32_t)getpid() ||
      r->hdr_bytes != MT_INJ_HDR_BYTES || (r->data_bytes & (r->data_bytes - 1)) != 0 ||
      r->hdr_bytes + r->data_bytes > (uint64_t)st.st_size) {
    munmap(m, (size_t)st.st_size);
    return 1;
  }
  pthread_mutex_lock(&g_attach_lock);
  int out = 2;
  struct view* old = __atomic_load_n(&g_view, __ATOMIC_ACQUIRE);
  const char* bad = NULL;
  struct view* v = NULL;
  if (old && !old->off && __atomic_load_n(&old->hdr->state, __ATOMIC_RELAXED) == MT_INJ_ATTACHED && loader_alive(old)) {
    static char why[96];
    snprintf(why, sizeof why, "another memtrace-bpf (pid %u) records this process", old->hdr->loader_pid);
    bad = why;
  } else if (!g_real_ok && (bad = r->fn_count ? resolve_given(r) : resolve_real()) == NULL) {
    g_real_ok = 1;
  }
  if (!bad) {
    void* vm = mmap(NULL, sizeof *v, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (vm == MAP_FAILED) bad = "no memory for the agent's state";
    else v = (struct view*)vm;
  }
  if (!bad && !g_atfork_ok) {
    if (pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0) bad = "pthread_atfork failed";
    else g_atfork_ok = 1;
  }
  if (bad) {
    agent_failed(r, bad); /* the loader reads it from its own mapping */
    if (v) munmap(v, sizeof *v);
    munmap(m, (size_t)st.st_size);
    pthread_mutex_unlock(&g_attach_lock);
    return out;
  }
  v->hdr = r;
  v->data = (char*)m + r->hdr_bytes;
  v->mask = r->data_bytes - 1;
  v->stack_mode = (int)r->stack_mode;
#if defined(__x86_64__)
  v->tsc = r->ts_mode == MT_INJ_TS_TSC;
  /* Python frames: the loader found CPython and says where its frames are */
  v->py = r->py_frames && r->py.tss_addr && v->stack_mode != MT_INJ_STACK_NONE;
  v->pyp = r->py;
#endif
  g_pid = (uint32_t)getpid();
  if (v->stack_mode == MT_INJ_STACK_CFI && !cfi_view(v, r, (uint64_t)st.st_size)) v->stack_mode = MT_INJ_STACK_LIBUNWIND;
  v->cfi_verify = v->stack_mode == MT_INJ_STACK_CFI && (r->hook_flags & MT_INJ_CFI_VERIFY);
  if ((v->stack_mode == MT_INJ_STACK_LIBUNWIND || v->stack_mode == MT_INJ_STACK_CFI) && !g_unw_backtrace) {
    void* u = real.dlopen("libunwind.so.8", RTLD_NOW | RTLD_LOCAL);
    if (u) {
      g_unw_backtrace = (unw_backtrace_fn)dlsym(u, "unw_backtrace");
      /* heaptrack's setting: a cache per thread, no lock per unwind. */
      typedef int (*policy_fn)(void*, int);
      policy_fn set_policy = (policy_fn)dlsym(u, "_ULx86_64_set_caching_policy");
      void** as = (void**)dlsym(u, "_ULx86_64_local_addr_space");
      if (set_policy && as) set_policy(*as, 2 /* UNW_CACHE_PER_THREAD */);
    }
  }
  if (v->stack_mode == MT_INJ_STACK_LIBUNWIND && !g_unw_backtrace) v->stack_mode = MT_INJ_STACK_FP;
  /* MT_INJ_STACK_CFI without libunwind: the rows alone (stack_cut counts what they could not finish) */
  r->stack_used = (uint32_t)v->stack_mode;
  void* seen = mmap(NULL, sizeof(uint64_t) << SEEN_BITS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  v->seen = seen == MAP_FAILED ? NULL : (uint64_t*)seen;
  /* A new session's rate (0: every call); sampled blocks of an earlier one
   * stay marked (their frees recorded: the new model finds no block). */
  __atomic_store_n(&g_sample, r->sample_bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&g_view, v, __ATOMIC_RELEASE);
  if (!(r->hook_flags & MT_INJ_NO_GOT)) rewrite_all();
  list_entries(r);
  __atomic_store_n(&r->agent_state, MT_INJ_AGENT_HOOKED, __ATOMIC_RELEASE);
  if (old) {
    /* Its memory given back; a hook still writing there gets fresh pages. */
    madvise(old->data, old->mask + 1, MADV_REMOVE);
    if (old->seen) madvise(old->seen, sizeof(uint64_t) << SEEN_BITS, MADV_DONTNEED);
    if (old->cfi.memo) madvise(old->cfi.memo, mt_cfi_memo_bytes(), MADV_DONTNEED); /* zeroes: misses */
  }
  out = 0;
  pthread_mutex_unlock(&g_attach_lock);
  return out;
}

__attribute__((constructor)) static void agent_init(void) { (void)attach_ring(); }

/* A later --inject into a process that has the agent: the injector calls
 * this instead of dlopen (which would not run the constructor again).
 * 0: hooked; 1: no ring for this process; 2: refused (the ring's
 * agent_error says why). */
EXPORT int memtrace_agent_attach(void) { return attach_ring(); }

/* For tests: whether this process's hooks record (1) or call straight through (0). */
EXPORT int memtrace_agent_recording(void) {
  struct view* v = __atomic_load_n(&g_view, __ATOMIC_ACQUIRE);
  return v && !v->off && __atomic_load_n(&v->hdr->state, __ATOMIC_RELAXED) == MT_INJ_ATTACHED && loader_alive(v);
}
