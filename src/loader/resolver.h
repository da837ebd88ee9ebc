// Glue between the loader's processes and src/symbolize: captures each
// traced process's mappings while it lives (one address space per image:
// an exec starts a new one), seals the stacks of images that ended into
// locations, and turns stack frames into report frames.
#pragma once
#include <sys/types.h>

#include <functional>
#include <map>
#include <string>
#include <memory>
#include <set>
#include <tuple>
#include <vector>

#include "heap/heap_model.h"
#include "python/python.h"
#include "report/report.h"
#include "symbolize/perf_map.h"
#include "symbolize/symbolize.h"

namespace memtrace::loader {

// One image's mappings, and the parent's at the fork that made the process
// (addresses of blocks a child inherited may be in mappings only the parent
// had by the time the child was read).
struct SpaceNode {
  symbolize::AddressSpace as;
  std::shared_ptr<const SpaceNode> parent;
};
using AddressSpaces = std::map<pid_t, std::shared_ptr<SpaceNode>>;

// Frames for addr in node's address space, else its ancestors' (a forked
// child's address not in its own mappings). missing: the reason when no
// space is known (node null).
std::vector<report::FrameOut> resolve_frames(symbolize::Symbolizer& sym, const SpaceNode* node, uint64_t addr,
                                             bool return_address, const char* missing);
// Could addr be a return address in node's address space (else its
// ancestors')? symbolize::follows_call in the first that maps it; false in
// none while one has mappings, but for a JIT's process (anonymous code:
// made since the read, maybe); true when none has (nothing is known).
bool follows_call(symbolize::Symbolizer& sym, const SpaceNode* node, uint64_t addr);
// Where the code of node's address space lies (its own mappings first, then
// its ancestors' in the gaps): what the heap model seals an image's stacks by.
heap::ImageMap image_map(symbolize::Symbolizer& sym, const SpaceNode* node);
// m is a JIT's image (anonymous code, or a perf map): its addresses in
// anonymous code and in no mapping are kept as locations (jit_module).
void mark_jit(symbolize::Symbolizer& sym, heap::ImageMap& m);
// A JIT's frame named by its process's perf map (addr: a return address
// when return_address; module: what the frame says it is in), if the map has it.
std::optional<report::FrameOut> jit_frame(const symbolize::PerfMap& m, uint64_t addr, bool return_address,
                                          const std::string& module);
// Whether resolve_frames found nothing for a frame a perf map may name
// (anonymous executable memory, or no mapping: code made since the read).
bool jit_candidate(const std::vector<report::FrameOut>& frames);
// A Python frame (addr & heap::kPyFrameTag: its id in t) as a report frame:
// "qualname (file.py:line)", module "python".
report::FrameOut python_frame(const python::FrameTable* t, uint64_t addr);
// Frames of a sealed stack's location (addr: where it was, for show).
std::vector<report::FrameOut> location_frames(symbolize::Symbolizer& sym, const heap::Loc& loc, uint64_t addr,
                                              bool return_address);

// Executable code of a file as the kernel mapped it (MT_EV_MAPFILE, system-
// wide): what a process's address space is made of when it exits before
// its /proc/PID/maps could be read.
struct KernelMapping {
  bool exe = false;       // the program an exec started: [start, end) its code (the first
                          // executable PT_LOAD at start), base: ld.so's load address (0: none)
  uint64_t exec_id = 0;   // exe: the exec's id (as Resolver::exec's)
  uint64_t start = 0, end = 0;
  uint64_t offset = 0;    // library: file offset of start
  uint64_t base = 0;
  uint64_t dev = 0, inode = 0;  // makedev(major, minor), as /proc/PID/maps has them
  std::string path;       // exe: the file executed, as named; library: its name without directory
  bool name_cut = false;  // library: path is the first bytes of a longer name
};

class Resolver {
 public:
  explicit Resolver(symbolize::Options opts) : sym_(std::move(opts)) {}
  // Capture (or extend) pid's current image's mappings now, while it lives.
  // maps: read already by the caller (one read per event); else read here.
  void capture(pid_t pid, const std::vector<procfs::Mapping>* maps = nullptr);
  // A child starts with its parent's mappings (captured now).
  void inherit(pid_t parent, pid_t child, const std::vector<procfs::Mapping>* maps = nullptr);
  // The same without a read (system-wide: a fork is not stopped, the child
  // may be gone already): until it execs, its addresses are its parent's,
  // those of the parent's image at the fork (fork_ts: the fork's time).
  // The fork comes from the events ring, the child's exec (and the parent's
  // next one) from the lifecycle ring, often first: images started after
  // the fork stay.
  void forked(pid_t parent, pid_t child, uint64_t fork_ts);
  // pid exec'd (exec_id: the exec's id, as heap::Process::exec_ts): a new
  // image, a new address space, captured now.
  void exec(pid_t pid, uint64_t exec_id, const std::vector<procfs::Mapping>* maps = nullptr);
  // The kernel mapped code for pid (system-wide). Kept with its image; given
  // to the image's address space if pid's maps cannot be read any more (it
  // exited first): on_given is told what it got (the recording keeps it).
  void kernel_mapped(pid_t pid, const KernelMapping& k);
  // pid's maps cannot be read (tests: MEMTRACE_TEST_UNREADABLE_COMM): as
  // exec() or capture() of a process that is gone.
  void unreadable(pid_t pid, uint64_t exec_id);
  // pid exited: what it mapped after its last read goes to its space.
  void exited(pid_t pid);
  void on_given(std::function<void(pid_t, const std::vector<procfs::Mapping>&)> f) { on_given_ = std::move(f); }
  // pid is gone and every image of it is sealed: its spaces go (a child's
  // link to them stays while the child needs it).
  void forget(pid_t pid);
  // For the heap model's sealing (HeapModel::set_locator): where p's code
  // lies, its own mappings first, then its parents' in the gaps.
  heap::ImageMap map_of(const heap::Process& p);
  std::vector<report::FrameOut> resolve(const heap::Process& p, uint64_t addr, const heap::Loc* loc,
                                        bool return_address);
  // Python frames' names (src/python): the tracer's table.
  void set_python(const python::FrameTable* t) { py_ = t; }
  // The final report: debuginfod may be asked from now on (symbolize.h).
  void allow_debuginfod() { sym_.allow_debuginfod(); }
  report::Resolver fn() {
    return [this](const heap::Process& p, uint64_t a, const heap::Loc* l, bool r) { return resolve(p, a, l, r); };
  }
  heap::Locator locator() {
    return [this](const heap::Process& p) { return map_of(p); };
  }
  size_t spaces() const { return images_.size(); }
  // The perf maps of the processes seen (JIT code names, read now as far
  // as they grew): (pid, every byte read), for the recording.
  std::vector<std::pair<pid_t, std::string>> perf_map_texts();
  // pid's perf map, found while it lives through /proc/PID/root and its own
  // pid namespace's pid (a container's), else /tmp/perf-PID.map; read
  // again as it grows (refresh: now, unless read in the last 20 ms).
  const symbolize::PerfMap* perf_map(pid_t pid, bool refresh);

 private:
  const python::FrameTable* py_ = nullptr;
  struct Image {
    Image(uint64_t id, std::shared_ptr<SpaceNode> n);
    uint64_t exec_id = 0;  // 0: the image running when first seen (or a fork's)
    uint64_t since = 0;    // when the resolver made it (CLOCK_MONOTONIC ns, the records' clock)
    std::shared_ptr<SpaceNode> node;
    bool gone = false;                   // its last /proc read failed
    std::vector<KernelMapping> pending;  // code mapped since its last /proc read
    KernelMapping exe;                   // the program's record (its exec's; a fork's: the parent's)
    std::string program;                 // exe's file, once found ("": not yet or never)
    bool started_read = false;           // its environ and cmdline read (note_started)
    pid_t parent = 0;                    // the process that forked it (0: not known)
  };
  // A read of pid's maps: done (drops what the kernel told before it: the
  // read has it), or failed (gives it to the space).
  void after_read(pid_t pid, Image& im, bool ok);
  void give(pid_t pid, Image& im, const KernelMapping& k);
  void ended(pid_t pid, Image& im);   // im will not be read again: gone, pending given
  void flush(pid_t pid, Image& im);   // its pending records given now
  std::vector<procfs::Mapping> mappings_of(const KernelMapping& k, Image& im);
  // A library record's file by its name: in the program's RUNPATH/RPATH,
  // LD_LIBRARY_PATH's, ld.so.cache's and ld.so's default directories, the
  // directories other processes' maps named, the paths their arguments
  // named; only a file whose (dev, inode) are the record's.
  std::string find_library(const KernelMapping& k, Image& im);
  const std::string& program_of(Image& im);
  void note_paths(pid_t pid, const std::vector<procfs::Mapping>* maps);
  // What pid was started with, read once per image while it lives: its
  // LD_LIBRARY_PATH's directories and the shared objects its arguments
  // name by path (ld's -plugin .../liblto_plugin.so, a dlopen's argument),
  // where the libraries of gone processes are looked for too.
  void note_started(pid_t pid, Image& im);
  // pid's environ and cmdline (prog: its program, for $ORIGIN; "": not
  // known): true when they told of a place not known before.
  bool note_strings(pid_t pid, const std::string& prog);
  size_t searched() const {
    return dirs_.size() + env_dirs_.size() + named_files_ + foreign_dirs_.size() + container_pids_.size();
  }
  // The roots of live processes that are not the tool's (containers: another
  // mount namespace or a chroot), /proc/PID/root, one per root: im's
  // parent's, then those of processes whose maps named files of another
  // root. A gone process's paths name files of its root, maybe one of these.
  std::vector<std::string> roots_of(const Image& im);
  // path in one of those roots, if it is (dev, inode) there (root: set to that root).
  std::string in_roots(const std::string& path, uint64_t dev, uint64_t inode, const Image& im, std::string* root);
  // A path of paths_ still the file (one through /proc/PID/root goes with PID)?
  bool still_there(const std::string& path, uint64_t dev, uint64_t inode) const;
  // pid's image p lives in (by exec id; else the newest older one; else its first).
  const SpaceNode* node_of(const heap::Process& p) const;
  const Image* image_of(const heap::Process& p) const;
  SpaceNode& current(pid_t pid);
  void read(SpaceNode& n, pid_t pid, const std::vector<procfs::Mapping>* maps, bool first_of_image);

  symbolize::Symbolizer sym_;
  struct Jit {
    symbolize::PerfMapFile file;
    uint64_t last_ns = 0;  // last refresh (or open attempt)
  };
  std::map<pid_t, Jit> jit_;  // perf maps by pid
  std::map<pid_t, std::vector<Image>> images_;  // by pid, in exec order
  std::set<pid_t> never_captured_;  // of processes not forgotten yet
  std::set<pid_t> incomplete_;
  size_t never_captured_gone_ = 0, incomplete_gone_ = 0;  // of forgotten ones
  // Files by (dev, inode) as some process's maps named them: a gone
  // process's libraries are found here.
  std::map<std::pair<uint64_t, uint64_t>, std::string> paths_;
  std::set<std::string> dirs_;                                 // their directories
  std::set<std::pair<uint64_t, uint64_t>> foreign_;            // files of another root (a container's)
  std::set<std::string> foreign_dirs_;                         // their directories (in that root)
  std::set<pid_t> container_pids_;                             // processes that mapped them
  std::map<std::string, std::vector<std::string>> root_system_dirs_;  // a root's ld.so.cache dirs
  std::set<std::string> env_dirs_;                             // LD_LIBRARY_PATH's of processes read
  std::map<std::string, std::set<std::string>> named_;         // file name -> paths arguments named
  size_t named_files_ = 0;
  std::set<std::pair<pid_t, uint64_t>> parents_read_;  // parents read at a lookup (once each: pid, start time)
  std::map<std::string, std::vector<std::string>> runpaths_;   // program -> its RUNPATH, $ORIGIN expanded
  std::vector<std::string> system_dirs_;                       // ld.so.cache's, then ld.so's defaults
  // Files looked for in vain, by (dev, inode, program): searched() then
  // (looked for again once more directories are known).
  std::map<std::tuple<uint64_t, uint64_t, std::string>, size_t> not_found_;
  size_t kernel_given_ = 0, kernel_unresolved_ = 0, misread_ = 0;
  std::function<void(pid_t, const std::vector<procfs::Mapping>&)> on_given_;

 public:
  // Processes that exited before their mappings could be read (system-wide
  // mode does not stop new processes): their frames stay unsymbolized.
  size_t never_captured() const { return never_captured_.size() + never_captured_gone_; }
  // Processes gone before a later read (a library mapped after the first
  // read): frames in that library stay unsymbolized.
  size_t incomplete() const { return incomplete_.size() + incomplete_gone_; }
  // Of those, mappings rebuilt from the kernel's records (MT_EV_MAPFILE),
  // and such records whose file could not be found.
  size_t kernel_given() const { return kernel_given_; }
  size_t kernel_unresolved() const { return kernel_unresolved_; }
  // Exec reads that found a later exec's program (that image's mappings:
  // dropped, the kernel's records used).
  size_t misread() const { return misread_; }
};

}  // namespace memtrace::loader
