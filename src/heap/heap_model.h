// The heap model: live blocks, mappings and counters per process, built from
// the ring-buffer records of bpf/memtrace.h. No BPF, no I/O: the loader feeds
// it, the reports read it.
#pragma once
#include <sys/types.h>

#include <array>
#include <chrono>
#include <deque>
#include <cstdint>
#include <map>
#include <memory>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "heap/addr_map.h"
#include "memtrace.h"

namespace memtrace::heap {

struct StackAllocs;

struct Block {
  uint64_t size = 0;
  uint64_t stack_id = 0;
  uint64_t ts = 0;
  bool touched = false;  // a page fault landed in it (fault tracking on)
  bool py = false;       // the python domain's (pymalloc: MT_ROLE_PY_*), not malloc's
  // The model's own: Process::stack_allocs[stack_id] of the block's process
  // (saves a lookup per free).
  StackAllocs* stack = nullptr;
  // The blocks it stands for: 1, or under --sample-bytes (issue 34) a
  // sampled block's weight 1 / (1 - exp(-s / N)), rounded at random (up
  // with the fraction's probability: unbiased); size is then its bytes'
  // estimate, s times the weight.
  uint64_t weight = 1;
};

// A frame of a sealed stack: an offset in a file. Module ids are the
// loader's (its symbolizer numbers the files it opened); 0 is never one.
// A stack frame that is no address (user addresses never have bit 63): a
// Python frame (src/python, issue 32), its id in the run's
// python::FrameTable, the same in every process. Sealed, it is the Loc
// {kPyModule, id}.
inline constexpr uint64_t kPyFrameTag = uint64_t{1} << 63;
inline constexpr uint32_t kPyModule = 0xffffffffu;

struct Loc {
  uint32_t module = 0;
  uint64_t offset = 0;
  bool operator==(const Loc& o) const { return module == o.module && offset == o.offset; }
};

struct Mapping {
  uint64_t len = 0;
  uint64_t stack_id = 0;
  bool allocator = false;  // mapped from inside an allocator call
  bool file = false;
  uint32_t prot = 0;
  uint32_t flags = 0;      // mmap flags (MAP_STACK: a thread stack)
  std::string path;        // file mappings: filled on the first fault (RegionLookup)
};

// ---- Page faults (issue 6): where a fault landed.
enum class Hit : uint8_t {
  Block,         // a live heap block: charged to its allocation stack
  Mmap,          // a direct mmap of the program (with its stack)
  AllocatorMap,  // memory the allocator mapped, outside any live block
  Heap,          // the brk heap, outside any live block
  Stack,         // the main thread's stack
  ThreadStack,   // a thread stack (MAP_STACK mapping or [stack:tid])
  File,          // a file mapping (path)
  Anon,          // other anonymous memory mapped before tracing started
  Other,         // [vdso], [vvar], ...
  Unmapped,      // no mapping: a crash (or stack growth)
};
const char* to_string(Hit);

struct FaultHit {
  Hit kind = Hit::Unmapped;
  uint64_t start = 0, end = 0;  // the block or mapping hit
  uint64_t stack_id = 0;        // Block: allocation stack; Mmap/ThreadStack: mmap's stack
  std::string path;             // File: the file; others: a /proc/PID/maps name when known
  bool first_touch = false;     // first fault on this page in this process
};

// What the loader knows from /proc/PID/maps for an address the model does not
// cover (mappings made before tracing, [heap], [stack], file paths).
// ts: when the fault happened (bpf_ktime_get_ns, CLOCK_MONOTONIC): a snapshot
// older than that may miss a mapping made since.
using RegionLookup = std::function<std::optional<FaultHit>(pid_t pid, uint64_t addr, uint64_t ts)>;
struct Process;
using FaultObserver = std::function<void(const Process&, const mt_event&, const FaultHit&)>;

struct FaultCounts {
  uint64_t total = 0, read = 0, write = 0, instr = 0;
  uint64_t pages_first_touched = 0;  // distinct pages that faulted (until unmapped)
  uint64_t access_errors = 0;        // answered with SIGSEGV: --rearm pages, or a crash
};

struct SiteFaults {
  uint64_t faults = 0, pages = 0, reads = 0, writes = 0;
  Hit kind = Hit::Block;  // by stack: Block (malloc family) or Mmap (direct mmap)
};

struct SiteAllocs {  // allocations by stack, kept while faults are traced
  uint64_t bytes = 0, blocks = 0, touched_blocks = 0;
};

// Allocations of one stack aggregated by (alloc time bucket, free time
// bucket): bucket b covers [span_t0 + b * span_bucket_ns, + span_bucket_ns).
// A block live at any time in buckets [a, b]: alloc_bucket <= b && free_bucket >= a.
inline constexpr uint16_t kSpanLive = 0xffff;  // free_bucket of blocks live now
inline constexpr uint32_t kSpanBuckets = 128;  // at most; then the width doubles and pairs merge
struct Span {
  uint16_t alloc_bucket = 0;
  uint16_t free_bucket = kSpanLive;  // kSpanLive: still live
  uint64_t bytes = 0, count = 0;
};

// Allocator calls by allocation stack (always kept: one entry per distinct
// stack of the process, for the folded and pprof outputs' alloc counts, the
// churn and the peak).
struct StackAllocs {
  uint64_t allocs = 0, bytes = 0;
  // Temporary allocations from this stack: see Summary::temporary_allocs.
  uint64_t temporary = 0;
  // Live bytes and blocks of this stack now (blocks inherited at fork too).
  uint64_t live_bytes = 0, live_blocks = 0;
  // Live bytes and blocks of this stack at the process's peak (the moment
  // Summary::peak_ts of Summary::peak_in_use_bytes): over all stacks they sum
  // to peak_in_use_bytes. Exact after every record.
  uint64_t peak_bytes = 0, peak_blocks = 0;
  // Sealed images only (their blocks are dropped): live blocks of this stack
  // no page fault landed in (--faults), for the leak groups.
  uint64_t untouched_blocks = 0;
  // The model's own: live_* changed since the peak (peak_* to be updated at
  // the next new peak); Process::spans[this stack] (saves a lookup per event).
  bool peak_dirty = false;
  std::vector<Span>* spans = nullptr;
  // Its allocations are the python domain's (pymalloc): a call site calls
  // one allocator (the last one's, should one call both).
  bool python = false;
};

// One allocator domain's part of a Summary (issue 32): the python domain,
// CPython's pymalloc (PyObject_Malloc and friends, bpf/memtrace.h
// MT_ROLE_PY_*). Its blocks are in the Summary's totals too; the malloc
// domain's are the totals less these.
struct DomainSummary {
  uint64_t allocs = 0, frees = 0, bytes_allocated = 0;
  uint64_t in_use_bytes = 0, in_use_blocks = 0, peak_in_use_bytes = 0;
  uint64_t failed_allocs = 0, unknown_frees = 0;
};

struct Summary {
  uint64_t allocs = 0, frees = 0, bytes_allocated = 0;
  uint64_t in_use_bytes = 0, in_use_blocks = 0, peak_in_use_bytes = 0;
  uint64_t failed_allocs = 0;
  uint64_t mmap_bytes_allocator = 0, mmap_bytes_direct = 0;  // cumulative bytes mapped
  uint64_t mapped_now_allocator = 0, mapped_now_direct = 0;  // bytes mapped now
  uint64_t mmap_calls = 0, munmap_calls = 0, mremap_calls = 0, brk_calls = 0;
  uint64_t brk_start = 0, brk_now = 0;
  uint64_t unknown_frees = 0;     // free of a block never seen allocated
  uint64_t inherited_blocks = 0;  // live blocks copied from the parent at fork
  // Temporary allocations, heaptrack's definition per thread: a block freed
  // by the thread that allocated it with no other allocator call (allocation
  // or free) of that thread in between (realloc: the free of the old block
  // at entry, then the new block at return). No age threshold: heaptrack has
  // none, and a time threshold would count differently on a faster machine;
  // how long blocks live is Process::lifetimes.
  uint64_t temporary_allocs = 0;
  // When in-use bytes first reached peak_in_use_bytes (ns, bpf_ktime_get_ns:
  // the events' clock). A fork's child starts at its parent's in-use bytes:
  // its peak_ts is then the parent's last event before the fork (0 if none).
  uint64_t peak_ts = 0;
  DomainSummary python;  // of the totals above: pymalloc's blocks
};

// How long freed blocks lived (free ts - alloc ts), log2 buckets: freed[i]
// counts blocks that lived [2^i, 2^(i+1)) ns (freed[0]: [0, 2) ns), and
// freed_bytes[i] their bytes. A realloc's old block is freed at the realloc.
struct Lifetimes {
  uint64_t live_at_end = 0;  // blocks still live (not in freed): Summary::in_use_blocks
  std::array<uint64_t, 64> freed{};
  std::array<uint64_t, 64> freed_bytes{};
};

// Memory over time: one point per interval of timeline_step_ns (a power of
// two) in which the process had an event; each value is the maximum over
// that interval (so the peak is a point), and holds until the next point.
struct TimelinePoint {
  uint64_t ts = 0;            // start of the interval (ns, the events' clock)
  uint64_t in_use_bytes = 0;  // malloc family
  uint64_t mapped_bytes = 0;  // mmap'd now (allocator's and direct) + the brk heap
  uint64_t touched_pages = 0; // distinct pages touched by faults now (--faults; else 0)
};
inline constexpr size_t kTimelinePoints = 512;  // at most; then the interval doubles and pairs merge


// A realloc's old block between its free at entry and the return.
struct ParkedFree {
  uint64_t addr = 0;
  Block block;
  uint64_t ts = 0;         // of the free
  bool temporary = false;  // it was its thread's last allocation
  uint64_t prev_last = 0;  // the thread's last allocation before the free (restored if realloc fails)
};

// Not copyable: its blocks, stacks and lists point into its own maps.
struct Process {
  Process() = default;
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid = 0;
  pid_t ppid = 0;
  std::string comm;
  // Its cgroup v2 path ("/system.slice/docker-<id>.scope"; "": not known),
  // read once when the tracer first names it, a fork's and an exec's kept.
  std::string cgroup;
  std::optional<int> exit_code;  // wait-status style: code << 8 | signal
  bool exited = false;
  Summary s;
  // Time this image was traced: its first and last event (ns, the events'
  // clock; a fork's child starts at its parent's last event). Churn of a
  // stack = StackAllocs::allocs / (last_ts - first_ts).
  uint64_t first_ts = 0, last_ts = 0;
  uint64_t timeline_step_ns = 0;        // interval of a timeline point (0 before the first event)
  uint64_t span_t0 = 0, span_bucket_ns = 0;  // span_bucket_ns: a power of two (0 before the first event)
  std::vector<TimelinePoint> timeline;  // at most kTimelinePoints, in time order
  // The model's own: the thread of the last allocator call and the block it
  // allocated last if no call of that thread came since (temporary
  // allocations); the other threads' in last_alloc_by_tid. Stacks whose live
  // bytes changed since the peak.
  uint32_t cur_tid = 0;
  uint64_t cur_tid_last = 0;
  AddrMap<uint64_t> last_alloc_by_tid;  // by tid (no node per thread switch)
  std::vector<StackAllocs*> peak_dirty;
  Lifetimes lifetimes;  // of freed blocks, malloc family
  AddrMap<Block> live;  // by address (open addressing: an insert or erase moves other entries)
  std::unordered_map<uint64_t, StackAllocs> stack_allocs;  // by stack id: malloc family only
  // For the temporal flame graph: by stack id, sorted by (alloc_bucket,
  // free_bucket); at most kSpanBuckets buckets from span_t0 on.
  std::unordered_map<uint64_t, std::vector<Span>> spans;
  std::map<uint64_t, Mapping> maps;  // by start
  // realloc(p, n): p's block, parked from its free at entry until the return
  // says whether realloc succeeded (if not, its free is undone: counters,
  // lifetime, span, temporariness).
  std::unordered_map<uint32_t, ParkedFree> realloc_parked;

  // Page faults (only with fault tracking on).
  FaultCounts f;
  std::unordered_map<uint64_t, SiteFaults> fault_stacks;  // Block and stacked Mmap hits by stack
  std::map<std::string, SiteFaults> fault_regions;        // other hits by region label
  std::unordered_map<uint64_t, SiteAllocs> alloc_sites;   // bytes allocated (or mmap'd) by stack
  std::set<uint64_t> touched;                             // pages that faulted
  std::map<uint64_t, uint64_t> live_index;                // live block start -> end
  uint64_t exec_ts = 0;     // the exec that started this image (0: running when first seen)
  uint32_t exec_count = 0;  // execs seen (a /proc/PID/maps snapshot from before is stale)
  uint32_t image = 0;       // index among pid's reported images (an idle image before an exec is not one)
  bool ended_by_exec = false;  // an earlier image of pid: it exec'd (its blocks died with it)
  bool from_fork = false;      // started by a fork the model saw: inherited the parent's blocks
  bool prelude = false;        // the tool's own code before the program (launch): never an image

  // ---- Ended images (HeapModel::set_locator): sealed when they end.
  // Sealed: its stack ids are sealed stacks (address-free, shared by every
  // image of the same program), its per-block, per-thread and mapping state
  // is gone (counters, stacks, lifetimes, timeline and spans stay).
  bool sealed = false;
  // Sealed: load bias of each module in this image (address = bias + offset),
  // sorted by module id; a merged entry keeps its first member's.
  std::vector<std::pair<uint32_t, uint64_t>> bias;
  // A merged entry: ended images of one command name folded together
  // (HeapModel::set_image_cap); merged counts them, merged_pids holds the first few.
  uint64_t merged = 0;
  std::vector<pid_t> merged_pids;
};

// Address in image p of a sealed stack's frame (bias + offset; the offset
// itself when p does not know the module).
uint64_t address_of(const Process& p, const Loc& l);

// Whether a process (image) did anything the reports show.
bool active(const Process& p);

struct Stack {
  std::vector<uint64_t> ips;  // raw (from BPF): addresses in the process, innermost first
  std::vector<Loc> locs;      // sealed: where in which file, innermost first
  bool truncated = false;
  bool sealed = false;
};

// Where the code of an image lies: address ranges [start, end) whose
// location is (module, address - bias), sorted and not overlapping, and the
// module that stands for an address in none of them (nothing is known of it:
// sealing keeps no offset for it, else every process's unknown frames made
// stacks of their own).
struct ImageRange {
  uint64_t start = 0, end = 0;
  uint32_t module = 0;
  uint64_t bias = 0;
};
struct ImageMap {
  std::vector<ImageRange> ranges;
  uint32_t unknown = 0;
  // Could a frame at this location be a return address (the bytes before it
  // are a call)? A stack is cut, as truncated, at its first later frame
  // that could not, or that lies in no range while some are known (a frame-
  // pointer walk through code that keeps none read words that are no
  // frames). Unset: no frame in a range is doubted.
  std::function<bool(const Loc&)> follows_call;
  // The image has a JIT's code (anonymous executable memory): an address in
  // no range may be code made after its mappings were read; not cut there.
  bool jit = false;
  // Non-zero (a JIT's image): an address in no range is kept as the location
  // (jit_module, address), as its anonymous mappings' are (bias 0), so that
  // its perf map names it after the process is gone.
  uint32_t jit_module = 0;
};
using Locator = std::function<ImageMap(const Process& p)>;

// What a frame of a stack is, for cutting a walk that went wrong: a return
// address; no return address (the bytes before it are no call); or in no
// known mapping (the doubt of ImageMap::follows_call).
enum class FrameTrust { Good, Bad, Unmapped };
// How many of a stack's n frames (innermost first) to keep: up to its first
// frame after the innermost that is Bad or Unmapped, but an Unmapped one
// (or a run of them) that a Good frame follows is kept: a JIT's code made
// since its process was read, its callers' frames after it (node).
size_t trusted_frames(size_t n, const std::function<FrameTrust(size_t)>& trust);

class HeapModel {
 public:
  HeapModel();
  ~HeapModel();
  // One record from the events ring buffer (mt_event or mt_stack).
  void apply(const void* data, size_t len);
  // --sample-bytes N (issue 34): every allocation record is a sample of a
  // Poisson byte sampler of mean N, weighted (Block::weight) so that the
  // counters are estimates of the full figures. 0: every call (exact).
  void set_sample_bytes(uint64_t n) { sample_bytes_ = n; }
  uint64_t sample_bytes() const { return sample_bytes_; }

  Process& process(pid_t pid);
  Process* find(pid_t pid);
  const Process* find(pid_t pid) const;
  // The current image of each pid.
  const std::map<pid_t, std::unique_ptr<Process>>& processes() const { return procs_; }
  // Every image, by pid, then in exec order: the ones that exec'd (each with
  // its own counters, leaks and brk) and the current one. For reports.
  std::vector<const Process*> images() const;
  const Stack* stack(uint64_t id) const;

  // child inherits the parent's live blocks. From the MT_EV_FORK record in
  // the parent's events stream (apply: exact), or, if that was lost, from the
  // child's lifecycle record: a second call for the same fork does nothing.
  void on_fork(pid_t parent, pid_t child);
  void on_exit(pid_t pid, int code);
  // pid exec'd (ts: of the exec, the same in both records): a new image starts, the old one is kept
  // for the report. A second call for the same exec (the MT_EV_EXEC record
  // of the events stream, then the lifecycle record) does nothing.
  void on_exec(pid_t pid, uint64_t ts);
  // The image of pid ended by exec into a program that is not traced.
  void end_image(pid_t pid);
  void clear(pid_t pid);  // console 'clear': forget counters and blocks

  // Page-fault attribution (--faults): keeps live blocks in address order too.
  // Turn on before the first record.
  void enable_faults(RegionLookup lookup, FaultObserver observer = {});
  bool faults_enabled() const { return faults_; }
  // The block or mapping containing addr (no counting).
  FaultHit attribute(Process& p, uint64_t addr, uint64_t ts = 0);

  // ---- Ended images: the model's memory grows with live blocks and distinct
  // call paths, not with the processes that came and went.
  // With a locator, every image is sealed when it ends (exec, retire, pid
  // reuse): its stacks become sealed stacks (frames as module + offset, one
  // copy for every image of a program), its blocks are dropped (kept when
  // keep_blocks: --live lists every block) once their counts per stack are in.
  void set_locator(Locator l, bool keep_blocks = false);
  // At most n ended images are kept one by one (0: no cap); past it, the
  // oldest image of the command name with the most ended images is merged
  // into that name's merged entry (sums; the largest member's peak).
  // entries: and at most this many per-stack entries in them in all (a
  // compiler image can hold 100,000).
  void set_image_cap(size_t n, size_t entries = 500000) {
    image_cap_ = n;
    entry_cap_ = entries;
  }
  // pid exited (on_exit) and every record of it was applied: its image ends
  // now (kept for the reports if it did anything, or keep_idle). false: pid's
  // current image is not one that exited (a new process has the pid now).
  bool retire(pid_t pid, bool keep_idle);
  // Raw stacks that no unsealed image refers to are dropped: their ids are
  // returned, for the loader to make BPF send them again when they recur.
  // A dropped stack stays reachable until the next call (records queued
  // before BPF forgot it may still name it).
  std::vector<uint64_t> collect_stacks();
  size_t sealed_stack_count() const { return sealed_.size(); }
  size_t merged_images() const { return merged_total_; }
  // Sealing runs in steps: seal_some works on the images that ended until
  // the budget is spent (the drain goes on in between); finish_seals seals
  // every one (before anything reads their stacks: a report).
  void seal_some(std::chrono::steady_clock::duration budget);
  void finish_seals();
  size_t sealing() const { return sealing_.size(); }
  // Its cost: images sealed, ns in all, the longest image and the longest step (what the drain waited).
  struct SealStats {
    uint64_t images = 0, total_ns = 0, max_ns = 0, max_step_ns = 0;
  };
  const SealStats& seal_stats() const { return seal_stats_; }

  uint64_t malformed_records() const { return malformed_; }
  uint64_t missing_stacks() const { return missing_stacks_; }
  uint64_t event_count() const { return events_; }
  size_t stack_count() const { return stacks_.size(); }
  uint64_t faults_before_exec() const { return faults_before_exec_; }

 private:
  void alloc(Process& p, const mt_event& e);
  void free_block(Process& p, const mt_event& e);
  void mmap(Process& p, const mt_event& e);
  void munmap(Process& p, uint64_t addr, uint64_t len);
  void fault(Process& p, const mt_event& e);
  void index_add(Process& p, uint64_t addr, uint64_t size);
  void index_del(Process& p, uint64_t addr);
  void forget_pages(Process& p, uint64_t addr, uint64_t len);

  Process& fresh(pid_t pid);  // a new current image for pid; the old one is kept if it did anything
  void ended(std::unique_ptr<Process> p);  // p ended: sealed, kept, merged past the cap
  struct SealJob;
  bool seal_step(SealJob& j, std::chrono::steady_clock::time_point deadline);
  std::deque<std::unique_ptr<SealJob>> sealing_;
  uint64_t intern(const std::vector<Loc>& locs, bool truncated);
  void merge_into(Process& group, Process& img);
  bool merge_one(bool by_entries);
  std::map<pid_t, std::unique_ptr<Process>> procs_;
  std::vector<std::unique_ptr<Process>> ended_;  // images that exec'd, or a reused pid's exited process
  std::unordered_map<uint64_t, Stack> stacks_;   // raw, by BPF's id
  std::unordered_map<uint64_t, Stack> sealed_;   // sealed, by their own id (top bit set)
  std::unordered_map<uint64_t, Stack> graveyard_;  // dropped by the last collect_stacks
  Locator locator_;
  bool keep_blocks_ = false;
  size_t image_cap_ = 0, entry_cap_ = 0;
  size_t individual_ended_ = 0;   // sealed ended images not merged
  size_t individual_entries_ = 0; // their per-stack entries
  SealStats seal_stats_;
  size_t merged_total_ = 0;
  std::map<std::string, std::unique_ptr<Process>> groups_;  // merged entries by comm (and cgroup)
  // Sealed ended images kept one by one, by comm (and cgroup), oldest first (what
  // merge_one picks from), and their per-stack entries.
  struct Kept {
    std::deque<Process*> images;
    size_t entries = 0;
  };
  std::map<std::string, Kept> kept_;
  Process* last_ = nullptr;
  uint64_t malformed_ = 0, missing_stacks_ = 0, events_ = 0;
  uint64_t sample_bytes_ = 0;     // set_sample_bytes
  uint64_t weight_rng_ = 0x9e3779b97f4a7c15ull;  // the weights' random rounding (xorshift64)
  bool faults_ = false;
  uint64_t faults_before_exec_ = 0;
  RegionLookup lookup_;
  FaultObserver observer_;
};

// Label of a non-block hit, as shown in reports: "[heap]", "file /path", ...
std::string region_label(const FaultHit& h);

}  // namespace memtrace::heap
