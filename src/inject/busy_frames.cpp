#include "inject/busy_frames.h"

#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/ucontext.h>
#include <sys/user.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <set>

#include "common/fd.h"
#include "elf/elf_file.h"
#include "inject/injector.h"

namespace memtrace::inject {
namespace {

std::string base_name(const std::string& p) { return p.substr(p.rfind('/') + 1); }

// Frames followed before the rest is scanned (a loop in corrupt CFI).
constexpr int kMaxFrames = 512;
// How far the scan goes above its start (the old check's reach).
constexpr uint64_t kScanBytes = 32 << 10;

bool is_ld_so(const std::string& base) {
  return base.rfind("ld-linux", 0) == 0 || (base.rfind("ld-", 0) == 0 && base.find(".so") != std::string::npos);
}

}  // namespace

// Code whose locks the agent's dlopen may need (busy_frames.h).
Result<BusyCode> busy_code(pid_t pid, const std::vector<procfs::Mapping>* given) {
  Result<std::vector<procfs::Mapping>> read = std::vector<procfs::Mapping>{};
  if (!given) {
    read = procfs::read_maps(pid);
    if (!read) return read.error();
  }
  const std::vector<procfs::Mapping>* maps = given ? given : &*read;
  BusyCode out;
  const procfs::Mapping* libc = nullptr;
  for (const auto& m : *maps) {
    std::string b = base_name(m.path);
    if (m.exec() && is_ld_so(b)) out.ranges.push_back({m.start, m.end});
    if (!libc && m.file() && (b.rfind("libc.so", 0) == 0 || b.rfind("libc-2", 0) == 0)) libc = &m;
  }
  if (!libc) return out;
  auto elf = elf::ElfFile::open(procfs::openable_path(pid, *libc));
  if (!elf) return elf.error();
  auto runtime = [&](uint64_t vaddr) -> uint64_t {
    auto off = elf->vaddr_to_offset(vaddr);
    if (!off) return 0;
    for (const auto& m : *maps)
      if (m.exec() && m.dev == libc->dev && m.inode == libc->inode && *off >= m.offset && *off < m.offset + (m.end - m.start))
        return m.start + (*off - m.offset);
    return 0;
  };
  static const std::set<std::string> malloc_c = {
      "malloc", "free", "calloc", "realloc", "memalign", "aligned_alloc", "valloc", "pvalloc", "posix_memalign",
      "malloc_usable_size", "malloc_trim", "mallopt", "mallinfo", "mallinfo2", "malloc_stats", "malloc_info",
      "__libc_malloc", "__libc_free", "__libc_calloc", "__libc_realloc", "__libc_memalign", "__libc_valloc",
      "__libc_pvalloc", "cfree", "__default_morecore"};
  static const std::set<std::string> holders = {
      "dl_iterate_phdr", "dlopen", "dlmopen", "dlclose", "dlsym", "dlvsym", "dladdr", "dladdr1", "dlinfo",
      "__libc_dlopen_mode", "__libc_dlsym", "__libc_dlvsym", "__libc_dlclose", "fork", "_Fork", "__libc_fork",
      "pthread_create", "reallocarray", "__libc_reallocarray", "__libc_freeres"};
  uint64_t lo = UINT64_MAX, hi = 0;
  std::vector<std::pair<uint64_t, uint64_t>> funcs;  // every function, by vaddr
  for (const auto& sym : elf->symbols()) {
    if (sym.type != STT_FUNC && sym.type != STT_GNU_IFUNC) continue;
    funcs.push_back({sym.vaddr, sym.vaddr + sym.size});
    if (malloc_c.count(sym.name)) {
      lo = std::min(lo, sym.vaddr);
      hi = std::max(hi, sym.vaddr + sym.size);
    }
    if (holders.count(sym.name) && sym.size)
      if (uint64_t a = runtime(sym.vaddr)) out.ranges.push_back({a, a + sym.size});
  }
  if (lo < hi) {
    // Out to the neighbouring functions of other files.
    uint64_t from = 0, to = UINT64_MAX;
    for (const auto& [f, e] : funcs) {
      if (e <= lo && e > from && !(f >= lo && f < hi)) from = e;
      if (f >= hi && f < to) to = f;
    }
    if (from == 0) from = lo;
    if (to == UINT64_MAX) to = hi;
    uint64_t a = runtime(from), b = runtime(to - 1);
    if (a && b) out.ranges.push_back({a, b + 1});
  }
  return out;
}

// Whether a call instruction ends just before ra (a return address, not
// a function pointer or other data that happens to point into code).
bool after_call(int mem, uint64_t ra) {
  uint8_t c[7];
  if (ra < 7 || pread(mem, c, sizeof c, static_cast<off_t>(ra - 7)) != static_cast<ssize_t>(sizeof c)) return false;
  if (c[2] == 0xe8) return true;  // call rel32
  // call r/m64 (FF /2): 2, 3, 4, 6 or 7 bytes (register, disp8, SIB, disp32, SIB + disp32)
  for (int len : {2, 3, 4, 6, 7})
    if (c[7 - len] == 0xff && ((c[8 - len] >> 3) & 7) == 2) return true;
  return false;
}


Result<std::unique_ptr<BusyFrames>> BusyFrames::open(pid_t pid, const ProcessView* view) {
  std::unique_ptr<BusyFrames> bf(new BusyFrames(pid));
  if (view) {
    bf->maps_ = view->maps;
  } else {
    auto maps = procfs::read_maps(pid);
    if (!maps) return maps.error();
    bf->maps_ = std::move(*maps);
  }
  auto busy = busy_code(pid, &bf->maps_);
  if (!busy) return busy.error();
  bf->busy_ = std::move(*busy);
  if (view)
    for (const auto& r : view->busy_extra) bf->busy_.ranges.push_back(r);
  return bf;
}

void BusyFrames::refresh_maps() {
  if (auto m = procfs::read_maps(pid_)) {
    maps_ = std::move(*m);
    modules_.clear();  // a range may hold another file now (the tables stay in store_)
  }
}

const procfs::Mapping* BusyFrames::mapping_of(uint64_t a) const {
  for (const auto& m : maps_)
    if (a >= m.start && a < m.end) return &m;
  return nullptr;
}

// "pc in libc.so.6+0x98a1c" (the file offset), "pc 0x7f..." outside any mapping.
std::string BusyFrames::where(const char* what, uint64_t a) const {
  char buf[64];
  if (const auto* m = mapping_of(a)) {
    snprintf(buf, sizeof buf, "+0x%" PRIx64, a - m->start + m->offset);
    return std::string(what) + " in " + (m->path.empty() ? "an anonymous mapping" : base_name(m->path)) + buf;
  }
  snprintf(buf, sizeof buf, " 0x%" PRIx64, a);
  return std::string(what) + buf;
}

// The CFI table of an executable mapping's file (the vDSO's image read from
// the process), built once per file (TableStore), and where it is loaded.
const BusyFrames::Module& BusyFrames::module_of(const procfs::Mapping& m, int mem) {
  auto key = std::make_pair(m.start, m.end);
  if (auto it = modules_.find(key); it != modules_.end()) return it->second;
  Module& mod = modules_[key];
  Fd fd;
  std::string what = m.path;
  if (m.path == "[vdso]") {
    fd.reset(memfd_create("vdso", MFD_CLOEXEC));
    std::vector<char> img(m.end - m.start);
    if (!fd.valid() || pread(mem, img.data(), img.size(), static_cast<off_t>(m.start)) != static_cast<ssize_t>(img.size()) ||
        write(fd.get(), img.data(), img.size()) != static_cast<ssize_t>(img.size())) {
      mod.error = "the vDSO could not be read";
      return mod;
    }
  } else if (m.file()) {
    char mf[96];
    snprintf(mf, sizeof mf, "/proc/%d/map_files/%" PRIx64 "-%" PRIx64, pid_, m.start, m.end);
    fd.reset(::open(mf, O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) fd.reset(::open(procfs::openable_path(pid_, m).c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) {
      mod.error = base_name(m.path) + " could not be opened";
      return mod;
    }
  } else {
    return mod;  // anonymous code (a JIT's), [vsyscall]: where() says it
  }
  auto t = store_.get(fd.get(), what);
  if (!t) {
    mod.error = t.error().message;
    return mod;
  }
  // runtime = ELF vaddr + load bias; the executable PT_LOAD that holds the
  // mapping's file offset (as src/unwind/unwind_maps.cpp places it).
  const elf::Segment* seg = nullptr;
  for (const auto& s : (*t)->segments)
    if ((s.flags & PF_X) && m.offset >= (s.offset & ~uint64_t{0xfff}) && m.offset < s.offset + s.filesz) seg = &s;
  if (!seg) {
    mod.error = base_name(what) + ": no executable segment at file offset " + std::to_string(m.offset);
    return mod;
  }
  mod.bias = m.start - m.offset - (seg->vaddr - seg->offset);
  mod.table = *t;
  return mod;
}

std::string BusyFrames::scan(int mem, uint64_t sp, int frame, const std::string& why) {
  scans_++;
  std::string how = "stack scanned from frame " + std::to_string(frame) + ": " + why;
  const procfs::Mapping* st = mapping_of(sp);
  if (!st) return where("stack pointer", sp) + " (no mapping known; " + how + ")";
  uint64_t end = std::min<uint64_t>(st->end, sp + kScanBytes);
  std::vector<uint64_t> words((end - sp) / 8);
  ssize_t n = pread(mem, words.data(), words.size() * 8, static_cast<off_t>(sp));
  for (ssize_t i = 0; i < n / 8; i++)
    if (busy_.has(words[i]) && after_call(mem, words[i])) return where("return address", words[i]) + " (" + how + ")";
  return "";
}

#if defined(__x86_64__)
std::string BusyFrames::reason(pid_t tid, int mem) {
  user_regs_struct regs{};
  if (ptrace(PTRACE_GETREGS, tid, nullptr, &regs) != 0) return "its registers could not be read";
  auto peek = [&](uint64_t a, uint64_t* v) { return pread(mem, v, 8, static_cast<off_t>(a)) == 8; };
  uint64_t pc = regs.rip, sp = regs.rsp, bp = regs.rbp;
  bool exact = true;    // pc is where the thread is (the first frame, an interrupted context), not a return address
  bool bp_lost = false; // rbp's value in this frame is unknown (MT_RBP_UNKNOWN below)
  int sigframes = 0;
  for (int frame = 0; frame < kMaxFrames; frame++) {
    auto note = [&] {
      std::string s = " (frame " + std::to_string(frame);
      if (sigframes) s += sigframes == 1 ? ", past a signal frame" : ", past " + std::to_string(sigframes) + " signal frames";
      return s + ")";
    };
    if (busy_.has(pc))
      return where(frame == 0 ? "pc" : exact ? "interrupted pc" : "return address", pc) + (frame ? note() : "");
    // A signal frame: the handler returns to the restorer (mov $15, %rax;
    // syscall: rt_sigreturn) with rsp at the ucontext the kernel saved.
    static const uint8_t kSigreturn[9] = {0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05};
    uint8_t code[9];
    if (pread(mem, code, sizeof code, static_cast<off_t>(pc)) == sizeof code && !memcmp(code, kSigreturn, sizeof code)) {
      constexpr size_t g = offsetof(ucontext_t, uc_mcontext.gregs);
      uint64_t rip = 0, rsp = 0, rbp = 0;
      if (!peek(sp + g + REG_RIP * 8, &rip) || !peek(sp + g + REG_RSP * 8, &rsp) || !peek(sp + g + REG_RBP * 8, &rbp))
        return scan(mem, sp, frame, "a signal frame could not be read");
      pc = rip, sp = rsp, bp = rbp;
      exact = true, bp_lost = false;
      sigframes++;
      continue;
    }
    const procfs::Mapping* m = mapping_of(pc);
    if (!m || !m->exec()) return scan(mem, sp, frame, where("pc", pc) + " in no executable mapping");
    const Module& mod = module_of(*m, mem);
    if (!mod.table)
      return scan(mem, sp, frame, "no CFI for " + where("pc", pc) + (mod.error.empty() ? "" : ": " + mod.error));
    const mt_unwind_row* row = mod.table->lookup(pc - (exact ? 0 : 1) - mod.bias);
    if (!row || MT_ROW_CFA(row) == MT_CFA_NONE) return scan(mem, sp, frame, "no CFI for " + where("pc", pc));
    unwind::RowInfo r = unwind::decode_row(*row);
    uint64_t cfa = 0;
    switch (r.cfa) {
      case MT_CFA_RSP: cfa = sp + r.cfa_off; break;
      case MT_CFA_RBP:
        if (bp_lost) return scan(mem, sp, frame, "rbp lost at " + where("pc", pc));
        cfa = bp + r.cfa_off;
        break;
      case MT_CFA_RBP_DEREF:
        if (bp_lost || !peek(bp + r.cfa_off, &cfa)) return scan(mem, sp, frame, "rbp lost at " + where("pc", pc));
        break;
      case MT_CFA_PLT: cfa = sp + 8 + ((pc & 15) >= static_cast<uint64_t>(r.cfa_off) ? 8 : 0); break;
      case MT_CFA_END: return "";  // the outermost frame (_start, clone3)
      default: return scan(mem, sp, frame, "CFI not followed at " + where("pc", pc));
    }
    if (cfa <= sp) return scan(mem, sp, frame, "a frame that does not move up the stack at " + where("pc", pc));
    uint64_t ra = 0;
    if (!peek(cfa - 8, &ra)) return scan(mem, sp, frame, "the stack could not be read");
    switch (r.rbp) {
      case MT_RBP_AT_CFA:
        if (!peek(cfa + r.rbp_off, &bp)) return scan(mem, sp, frame, "the stack could not be read");
        bp_lost = false;
        break;
      case MT_RBP_AT_RBP:
        if (bp_lost || !peek(bp + r.rbp_off, &bp)) bp_lost = true;
        break;
      case MT_RBP_UNKNOWN: bp_lost = true; break;
      default: break;  // MT_RBP_SAME
    }
    if (ra == 0) return "";  // the end of the chain
    pc = ra, sp = cfa;
    exact = false;
  }
  return scan(mem, sp, kMaxFrames, "more than " + std::to_string(kMaxFrames) + " frames");
}
#else
std::string BusyFrames::reason(pid_t, int) { return "not supported on this architecture"; }
#endif

}  // namespace memtrace::inject
