#include "inject/trampoline.h"

#include <capstone/capstone.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "common/fd.h"
#include "elf/elf_file.h"
#include "inject/injector.h"
#include "probes/allocators.h"
#include "procfs/proc_maps.h"

#if defined(__x86_64__)
#include <sys/ptrace.h>
#include <sys/user.h>
#endif

namespace memtrace::inject {
namespace {

constexpr size_t kJmpLen = 5;  // e9 rel32

struct Capstone {
  csh h = 0;
  bool ok = false;
  Capstone() {
    ok = cs_open(CS_ARCH_X86, CS_MODE_64, &h) == CS_ERR_OK;
    if (ok) cs_option(h, CS_OPT_DETAIL, CS_OPT_ON);
  }
  ~Capstone() {
    if (ok) cs_close(&h);
  }
  Capstone(const Capstone&) = delete;
  Capstone& operator=(const Capstone&) = delete;
};

struct InsnList {
  cs_insn* p = nullptr;
  size_t n = 0;
  ~InsnList() {
    if (p) cs_free(p, n);
  }
};

std::string hex(uint64_t v) {
  char b[24];
  snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

std::string text(const cs_insn& i, uint64_t fn) {
  return std::string(i.mnemonic) + (i.op_str[0] ? std::string(" ") + i.op_str : "") + " at +" + hex(i.address - fn);
}

bool fits32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

void put32(std::vector<uint8_t>& out, size_t at, int32_t v) { memcpy(out.data() + at, &v, 4); }

// A direct branch: its kind (0 none, 'j' jmp, 'c' call, 'k' jcc + condition).
struct Branch {
  char kind = 0;
  uint8_t cond = 0;
  uint64_t target = 0;
};

Branch branch_of(const cs_insn& i) {
  Branch b;
  const cs_x86& x = i.detail->x86;
  if (x.op_count != 1 || x.operands[0].type != X86_OP_IMM) return b;
  uint8_t o0 = x.opcode[0], o1 = x.opcode[1];
  if (o0 == 0xe9 || o0 == 0xeb) b.kind = 'j';
  else if (o0 == 0xe8) b.kind = 'c';
  else if (o0 >= 0x70 && o0 <= 0x7f) b = {'k', static_cast<uint8_t>(o0 & 0xf), 0};
  else if (o0 == 0x0f && o1 >= 0x80 && o1 <= 0x8f) b = {'k', static_cast<uint8_t>(o1 & 0xf), 0};
  if (b.kind) b.target = static_cast<uint64_t>(x.operands[0].imm);
  return b;
}

bool has_prefix(const cs_insn& i) {
  for (uint8_t p : i.detail->x86.prefix)
    if (p) return true;
  return false;
}

}  // namespace

Result<Relocated> relocate_prologue(const std::vector<uint8_t>& code, size_t body_len, uint64_t fn, uint64_t stub_at,
                                    size_t min_len, const std::vector<uint64_t>& incoming) {
  thread_local Capstone cs;
  if (!cs.ok) return Error::msg("capstone: cannot open x86-64");
  Relocated r;
  std::vector<uint64_t> targets;  // direct branches of the prologue that stay in it
  size_t off = 0;
  while (off < min_len) {
    InsnList one;
    one.n = cs_disasm(cs.h, code.data() + off, code.size() - off, fn + off, 1, &one.p);
    if (one.n != 1) return Error::msg("undecodable instruction at +" + hex(off));
    const cs_insn& i = one.p[0];
    const cs_x86& x = i.detail->x86;
    size_t at = r.code.size();
    uint64_t next = fn + off + i.size;
    switch (i.id) {
      case X86_INS_JRCXZ: case X86_INS_JECXZ: case X86_INS_JCXZ: case X86_INS_LOOP: case X86_INS_LOOPE:
      case X86_INS_LOOPNE: case X86_INS_INT3: case X86_INS_RET: case X86_INS_UD2:
        return Error::msg(text(i, fn) + " in the first " + std::to_string(min_len) + " bytes cannot be moved");
      default: break;
    }
    Branch b = branch_of(i);
    if (b.kind) {
      if (has_prefix(i)) return Error::msg(text(i, fn) + ": a prefixed branch");
      if (b.target > fn && b.target < fn + min_len + 16) targets.push_back(b.target);
      // Re-encoded with rel32 from the stub.
      size_t len = b.kind == 'k' ? 6 : 5;
      int64_t rel = static_cast<int64_t>(b.target) - static_cast<int64_t>(stub_at + at + len);
      if (!fits32(rel)) return Error::msg(text(i, fn) + ": its target is out of reach of the stub");
      if (b.kind == 'k') {
        r.code.push_back(0x0f);
        r.code.push_back(static_cast<uint8_t>(0x80 | b.cond));
      } else {
        r.code.push_back(b.kind == 'j' ? 0xe9 : 0xe8);
      }
      r.code.resize(at + len);
      put32(r.code, at + len - 4, static_cast<int32_t>(rel));
      off += i.size;
      if (b.kind == 'j' && off < min_len) return Error::msg(text(i, fn) + ": the function ends before " + std::to_string(min_len) + " bytes");
      continue;
    }
    if (cs_insn_group(cs.h, &i, X86_GRP_JUMP) || cs_insn_group(cs.h, &i, X86_GRP_RET) ||
        cs_insn_group(cs.h, &i, X86_GRP_INT) || cs_insn_group(cs.h, &i, X86_GRP_IRET)) {
      // Indirect jmp (jmp [rip+x] included: it leaves the function).
      bool rip = false;
      for (int k = 0; k < x.op_count; k++)
        if (x.operands[k].type == X86_OP_MEM && x.operands[k].mem.base == X86_REG_RIP) rip = true;
      if (!rip || off + i.size < min_len)
        return Error::msg(text(i, fn) + ": control leaves the first " + std::to_string(min_len) + " bytes");
    }
    r.code.insert(r.code.end(), code.begin() + static_cast<long>(off), code.begin() + static_cast<long>(off + i.size));
    for (int k = 0; k < x.op_count; k++) {
      const cs_x86_op& op = x.operands[k];
      if (op.type != X86_OP_MEM || op.mem.base != X86_REG_RIP) continue;
      if (x.encoding.disp_offset == 0 || x.encoding.disp_size != 4)
        return Error::msg(text(i, fn) + ": rip-relative operand without a 32-bit displacement");
      uint64_t target = next + static_cast<int64_t>(op.mem.disp);
      int64_t disp = static_cast<int64_t>(target) - static_cast<int64_t>(stub_at + at + i.size);
      if (!fits32(disp)) return Error::msg(text(i, fn) + ": its operand is out of reach of the stub");
      put32(r.code, at + x.encoding.disp_offset, static_cast<int32_t>(disp));
    }
    off += i.size;
  }
  r.len = off;
  if (body_len && body_len < r.len) return Error::msg("the function is " + std::to_string(body_len) + " bytes, shorter than the jmp");
  // Nothing may branch into the replaced bytes after their first: not the
  // prologue itself, not the rest of the function, not other code.
  for (uint64_t t : targets)
    if (t > fn && t < fn + r.len) return Error::msg("a branch of its first bytes targets +" + hex(t - fn) + ", inside them");
  for (uint64_t t : incoming)
    if (t > 0 && t < r.len) return Error::msg("a branch elsewhere in its object targets +" + hex(t) + ", inside its first " + std::to_string(r.len) + " bytes");
  size_t scan = std::min(body_len ? body_len : code.size(), code.size());
  for (size_t at = 0; at < scan;) {
    InsnList one;
    one.n = cs_disasm(cs.h, code.data() + at, scan - at, fn + at, 1, &one.p);
    if (one.n != 1) {
      at++;
      continue;
    }
    Branch b = branch_of(one.p[0]);
    if (b.kind && b.target > fn && b.target < fn + r.len)
      return Error::msg(text(one.p[0], fn) + " branches into its first " + std::to_string(r.len) + " bytes");
    at += one.p[0].size;
  }
  // Back to the original after them.
  size_t at = r.code.size();
  int64_t rel = static_cast<int64_t>(fn + r.len) - static_cast<int64_t>(stub_at + at + kJmpLen);
  if (!fits32(rel)) return Error::msg("the stub is out of reach of the function");
  r.code.push_back(0xe9);
  r.code.resize(at + kJmpLen);
  put32(r.code, at + 1, static_cast<int32_t>(rel));
  return r;
}

// Whether a rel32 jmp, call or jcc of elf really branches to target: the
// object's byte scan (probes::incoming_branch_targets) takes any e8/e9/0f 8x
// byte with the right displacement for one; each such place inside a
// function symbol is checked by disassembling that function from its start
// (an instruction there, and that branch). A place in no function symbol
// (PLT, stripped code) counts as a branch: conservative.
bool really_branches_to(const elf::ElfFile& elf, uint64_t target) {
  thread_local Capstone cs;
  if (!cs.ok) return true;
  for (const auto& seg : elf.segments()) {
    if (!(seg.flags & PF_X) || seg.filesz < 5) continue;
    std::vector<uint8_t> b = elf.read_vaddr(seg.vaddr, seg.filesz);
    for (size_t p = 0; p + 5 <= b.size(); p++) {
      size_t ilen;
      if (b[p] == 0xe8 || b[p] == 0xe9) ilen = 5;
      else if (b[p] == 0x0f && p + 6 <= b.size() && b[p + 1] >= 0x80 && b[p + 1] <= 0x8f) ilen = 6;
      else continue;
      int32_t rel;
      memcpy(&rel, &b[p + ilen - 4], 4);
      uint64_t src = seg.vaddr + p;
      if (src + ilen + static_cast<int64_t>(rel) != target) continue;
      const elf::Symbol* f = nullptr;
      for (const auto& sym : elf.symbols())
        if ((sym.type == STT_FUNC || sym.type == STT_GNU_IFUNC) && sym.size && src >= sym.vaddr &&
            src < sym.vaddr + sym.size && sym.size <= (1u << 20)) {
          f = &sym;
          break;
        }
      if (!f) return true;
      std::vector<uint8_t> code = elf.read_vaddr(f->vaddr, f->size);
      uint64_t at = f->vaddr;
      bool real = false;
      while (at < src) {
        InsnList one;
        one.n = cs_disasm(cs.h, code.data() + (at - f->vaddr), code.size() - (at - f->vaddr), at, 1, &one.p);
        if (one.n != 1) {
          real = true;  // undecodable before it: cannot tell
          break;
        }
        at += one.p[0].size;
      }
      if (real) return true;
      if (at != src) continue;  // inside another instruction: not a branch
      InsnList one;
      one.n = cs_disasm(cs.h, code.data() + (src - f->vaddr), code.size() - (src - f->vaddr), src, 1, &one.p);
      if (one.n == 1 && branch_of(one.p[0]).kind && branch_of(one.p[0]).target == target) return true;
    }
  }
  return false;
}

// One file's: its ELF, every rel32 branch target in its code (sorted).
struct EntryFiles {
  struct File {
    std::shared_ptr<elf::ElfFile> elf;
    std::vector<uint64_t> targets;
  };
  std::map<std::string, File> by_path;  // as /proc/PID/maps names it
  // path's, read now if not yet; nullptr (and *why) if it cannot be.
  File* get(pid_t pid, const procfs::Mapping& m, std::string* why) {
    const std::string& path = m.path;
    auto& f = by_path[path];
    if (!f.elf) {
      auto e = elf::ElfFile::open(procfs::openable_path(pid, m));
      if (!e) {
        *why = e.error().message;
        by_path.erase(path);
        return nullptr;
      }
      f.elf = std::make_shared<elf::ElfFile>(std::move(*e));
      f.targets = probes::incoming_branch_targets(*f.elf, 0, uint64_t{1} << 48);
      std::sort(f.targets.begin(), f.targets.end());
    }
    return &f;
  }
};

void EntryFilesDeleter::operator()(EntryFiles* f) const { delete f; }

EntryFilesPtr prepare_entries(pid_t pid, const std::vector<procfs::Mapping>* given, const std::vector<uint64_t>& fns) {
  EntryFilesPtr files(new EntryFiles());
#if defined(__x86_64__)
  Result<std::vector<procfs::Mapping>> read = std::vector<procfs::Mapping>{};
  if (!given) {
    read = procfs::read_maps(pid);
    if (!read) return files;
  }
  const auto& maps = given ? *given : *read;
  for (const auto& m : maps) {
    if (!m.file() || !m.exec()) continue;
    std::string b = m.path.substr(m.path.rfind('/') + 1);
    std::string why;
    bool want = fns.empty() && (b.rfind("libc.so", 0) == 0 || b.rfind("libstdc++.so", 0) == 0);
    for (uint64_t f : fns) want |= f >= m.start && f < m.end;
    if (want) files->get(pid, m, &why);
  }
#else
  (void)pid;
  (void)given;
  (void)fns;
#endif
  return files;
}

#if !defined(__x86_64__)
Result<PatchReport> patch_entries(pid_t, mt_inj_hdr*, StoppedProcess*, EntryFiles*, const std::vector<procfs::Mapping>*) {
  return PatchReport{};
}
Result<uint32_t> unpatch_entries(pid_t, mt_inj_hdr*) { return 0u; }
#else
namespace {

// One entry to patch: what goes where.
struct Plan {
  uint32_t index = 0;
  std::string name;
  uint64_t fn = 0, stub = 0, island = 0, hook = 0, orig_slot = 0;
  std::vector<uint64_t> real_slots;  // the entry's and its aliases' (aligned_alloc is memalign in glibc)
  std::vector<uint8_t> orig;         // the file's bytes of [fn, fn + len)
  std::vector<uint8_t> stub_code;
  std::vector<uint8_t> glue;         // undoes the kept instructions before the hook
  size_t len = 0;                    // bytes relocated into the stub: [0, len)
  size_t keep = 0;                   // the jmp is at fn + keep: [0, keep) stays as the file has it
  bool thunk = false;                // a jmp to another function among them: nothing to patch here
  std::vector<uint64_t> probes;      // offsets a uprobe may sit on (the first instruction, the BPF path's)
};

// The agent's record of a patched entry (orig_slot): its first bytes as
// the file has them, their count, and as patched.
constexpr size_t kOrigMax = 32;
constexpr size_t kOrigBytes = kOrigMax + 1 + kOrigMax;

std::array<uint8_t, kJmpLen> jmp_of(const Plan& p) {
  std::array<uint8_t, kJmpLen> j{0xe9};
  int32_t d = static_cast<int32_t>(static_cast<int64_t>(p.island) - static_cast<int64_t>(p.fn + p.keep + kJmpLen));
  memcpy(j.data() + 1, &d, 4);
  return j;
}

// Where the jmp goes: after the instructions a uprobe may sit on, the
// first one (bcc's, bpftrace's, perf's offset 0) and those the BPF path
// chooses for this function (probes::place_function: its entry and return
// probes). A uprobe there runs the file's instruction and goes on after
// it, in bytes that are the file's; its unregister puts back the file's
// byte, over nothing of ours. Their effects are undone (glue) before the
// hook, which starts as at the entry: a push by lea rsp, [rsp + 8], a sub
// rsp by lea; flags (test, cmp), a copy into a scratch register and a
// conditional branch (free's NULL test: taken, the call goes on without
// the hook) need nothing. A direct jmp or call (a thunk, a wrapper of
// another allocator function) leaves the function alone, silently. Anything else is not kept: the
// function is refused.
Result<void> keep_probed(const std::vector<uint8_t>& code, uint64_t fn, const elf::ElfFile& elf, const elf::Symbol& sym,
                         uint32_t role_id, Plan* p, uint64_t upto) {
  thread_local Capstone cs;
  if (!cs.ok) return Error::msg("capstone: cannot open x86-64");
  probes::Role role = role_id < static_cast<uint32_t>(probes::Role::kCount) ? static_cast<probes::Role>(role_id)
                                                                            : probes::Role::kAlignedNew;
  probes::Placement pl = probes::place_function(elf, sym, probes::needs_for(role), probes::KernelCaps::running(), false);
  size_t keep = 0;
  p->probes = {0, pl.offset, probes::return_probe_offset(pl)};
  for (uint64_t x : p->probes) {
    // Only those the jmp would cover: one further on runs the file's
    // instruction there as it would unpatched (the stub jumps back before it).
    if (x != 0 && x >= upto) continue;
    if (x >= code.size()) return Error::msg("a probe offset +" + hex(x) + " past its code");
    InsnList one;
    one.n = cs_disasm(cs.h, code.data() + x, code.size() - x, fn + x, 1, &one.p);
    if (one.n != 1) return Error::msg("undecodable instruction at +" + hex(x));
    keep = std::max<size_t>(keep, x + one.p[0].size);
  }
  p->keep = keep;
  p->glue.clear();
  for (size_t off = 0; off < keep;) {
    InsnList one;
    one.n = cs_disasm(cs.h, code.data() + off, code.size() - off, fn + off, 1, &one.p);
    if (one.n != 1) return Error::msg("undecodable instruction at +" + hex(off));
    const cs_insn& i = one.p[0];
    const cs_x86& x = i.detail->x86;
    bool reg_push = i.id == X86_INS_PUSH && x.op_count == 1 && x.operands[0].type == X86_OP_REG;
    // A copy into rax, r10 or r11 (no argument, caller-saved: the hook may
    // find anything there) needs nothing either: reallocarray's mov rax, rsi.
    // Also a load or copy into rcx, r8, r9 (no hook takes a fourth
    // argument: the slot hooks pass rcx through unread) and xor of one of
    // them with itself: the stub runs it again from the same inputs.
    // rdx too where the hook takes no third argument (all but
    // reallocarray and posix_memalign: the slot hooks pass it on unread).
    bool rdx_free = role != probes::Role::kReallocarray && role != probes::Role::kPosixMemalign;
    auto scratch = [&](x86_reg r) {
      if (rdx_free && (r == X86_REG_RDX || r == X86_REG_EDX)) return true;
      switch (r) {
        case X86_REG_RAX: case X86_REG_EAX: case X86_REG_RCX: case X86_REG_ECX: case X86_REG_R8: case X86_REG_R8D:
        case X86_REG_R9: case X86_REG_R9D: case X86_REG_R10: case X86_REG_R10D: case X86_REG_R11: case X86_REG_R11D:
          return true;
        default: return false;
      }
    };
    bool scratch_mov = (i.id == X86_INS_MOV || i.id == X86_INS_LEA) && x.op_count == 2 &&
                       x.operands[0].type == X86_OP_REG && scratch(x.operands[0].reg) &&
                       (x.operands[1].type != X86_OP_MEM || i.id == X86_INS_LEA ||
                        (x.operands[1].mem.base == X86_REG_RIP && x.operands[1].mem.index == X86_REG_INVALID));
    bool scratch_xor = i.id == X86_INS_XOR && x.op_count == 2 && x.operands[0].type == X86_OP_REG &&
                       x.operands[1].type == X86_OP_REG && x.operands[0].reg == x.operands[1].reg &&
                       scratch(x.operands[0].reg);
    bool sub_rsp = i.id == X86_INS_SUB && x.op_count == 2 && x.operands[0].type == X86_OP_REG &&
                   x.operands[0].reg == X86_REG_RSP && x.operands[1].type == X86_OP_IMM && x.operands[1].imm >= 0 &&
                   x.operands[1].imm < (1 << 20);
    Branch b = branch_of(i);
    if ((b.kind == 'j' || b.kind == 'c') && b.target != fn) {
      // A thunk or wrapper (libstdc++'s aligned new[] jumps to new through
      // its PLT, the nothrow forms call it first): the function it goes to
      // is hooked through its own entry or GOT slot; this one is left as
      // it is.
      p->thunk = true;
      return Error::msg(text(i, fn) + ": goes to another entry first");
    } else if (scratch_mov || scratch_xor) {
    } else if (sub_rsp) {
      int32_t n = static_cast<int32_t>(x.operands[1].imm);  // lea rsp, [rsp + n]
      for (uint8_t b : {0x48, 0x8d, 0xa4, 0x24}) p->glue.push_back(b);
      for (int k = 0; k < 4; k++) p->glue.push_back(static_cast<uint8_t>(static_cast<uint32_t>(n) >> (8 * k)));
    } else if (reg_push) {
      for (uint8_t b : {0x48, 0x8d, 0x64, 0x24, 0x08}) p->glue.push_back(b);  // lea rsp, [rsp + 8]
    } else if (!(i.id == X86_INS_TEST || i.id == X86_INS_CMP || i.id == X86_INS_NOP || i.id == X86_INS_ENDBR64 ||
                 branch_of(i).kind == 'k')) {
      return Error::msg(text(i, fn) + ", before the probed instructions' end (+" + hex(keep) + "), cannot be undone");
    }
    off += i.size;
  }
  return {};
}

Result<void> mem_write(int mem, uint64_t addr, const void* p, size_t n) {
  if (pwrite(mem, p, n, static_cast<off_t>(addr)) != static_cast<ssize_t>(n)) return Error::sys("write " + hex(addr));
  return {};
}

// Where a jmp at fn (5 bytes) can go for entry i: an island in the area
// whose rel32 has no 0xcc byte. A uprobe placed at one of those bytes
// before (a launched program's, being closed) or after would take that
// byte for its own breakpoint and put the original back at unregister.
std::optional<uint64_t> island_for(uint64_t tramp, uint32_t i, uint64_t from) {
  for (uint64_t j = 0; j < 15; j++)
    for (uint64_t k = 0; k < 12; k++) {  // an island: up to 64 bytes
      uint64_t isl = tramp + 4096 + j * 16384 + i * 256 + k * 16;
      static_assert(MT_INJ_ENTRY_MAX * MT_INJ_TRAMP_SLOT <= 4096 && MT_INJ_ENTRY_MAX * 256 <= 16384 &&
                        4096 + 14 * 16384 + MT_INJ_ENTRY_MAX * 256 <= MT_INJ_TRAMP_BYTES,
                    "stubs in the first page, islands of entry i at 4096 + j * 16384 + i * 256");
      int64_t d = static_cast<int64_t>(isl) - static_cast<int64_t>(from + kJmpLen);
      if (!fits32(d)) continue;
      uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(d));
      bool cc = false;
      for (int b = 0; b < 4; b++) cc |= ((u >> (8 * b)) & 0xff) == 0xcc;
      if (!cc) return isl;
    }
  return std::nullopt;
}

// Whether thread tid is inside bytes being replaced: its pc, or a word in
// the top 32 KiB of its stack (a signal frame's saved pc), in (fn, fn + len).
bool inside(pid_t tid, int mem, const std::vector<Plan>& plans) {
  user_regs_struct regs{};
  if (ptrace(PTRACE_GETREGS, tid, nullptr, &regs) != 0) return true;
  auto in = [&](uint64_t a) {
    for (const auto& p : plans)
      if (a > p.fn && a < p.fn + p.len) return true;
    return false;
  };
  if (in(regs.rip)) return true;
  std::vector<uint64_t> words(4096);
  const size_t cap = words.size() * 8;
  ssize_t n = pread(mem, words.data(), cap, static_cast<off_t>(regs.rsp));
  if (n < 0) {
    // Less than 32 KiB to the stack's top: a page at a time.
    n = 0;
    for (uint64_t at = regs.rsp; static_cast<size_t>(n) < cap; at = (at | 4095) + 1) {
      size_t chunk = std::min<size_t>(((at | 4095) + 1) - at, cap - static_cast<size_t>(n));
      ssize_t got = pread(mem, reinterpret_cast<char*>(words.data()) + n, chunk, static_cast<off_t>(at));
      if (got <= 0) break;
      n += got;
    }
  }
  for (ssize_t k = 0; k < n / 8; k++)
    if (in(words[static_cast<size_t>(k)])) return true;
  return false;
}

}  // namespace

Result<PatchReport> patch_entries(pid_t pid, mt_inj_hdr* hdr, StoppedProcess* held, EntryFiles* files,
                                  const std::vector<procfs::Mapping>* given) {
  PatchReport rep;
  uint32_t count = std::min<uint32_t>(__atomic_load_n(&hdr->entry_count, __ATOMIC_ACQUIRE), MT_INJ_ENTRY_MAX);
  uint64_t tramp = hdr->tramp;
  if (!count) return rep;
  if (!tramp) {
    rep.refused.push_back("every entry: the agent found no room for its trampolines near libc");
    return rep;
  }
  Result<std::vector<procfs::Mapping>> read = std::vector<procfs::Mapping>{};
  if (!given) {
    read = procfs::read_maps(pid);
    if (!read) return read.error();
  }
  const std::vector<procfs::Mapping>* maps = given ? given : &*read;
  EntryFilesPtr own;
  if (!files) {
    own.reset(new EntryFiles());
    files = own.get();
  }
  std::vector<Plan> plans;
  std::map<uint64_t, size_t> by_fn;  // fn -> plans index (aliases)
  std::map<uint64_t, uint64_t> done_fn;  // fn -> stub of an earlier session
  for (uint32_t i = 0; i < count; i++) {
    const auto& e = hdr->entries[i];
    std::string name(e.name, strnlen(e.name, sizeof e.name));
    if (e.stub) {
      rep.already++;
      done_fn[e.fn] = e.stub;
      continue;
    }
    if (!e.fn || !e.hook || !e.real_slot) continue;
    if (auto it = done_fn.find(e.fn); it != done_fn.end()) {
      // Its alias was patched before: its pointer takes the same stub.
      Plan p;
      p.index = i;
      p.name = name;
      p.fn = e.fn;
      p.stub = it->second;
      p.real_slots = {e.real_slot};
      plans.push_back(std::move(p));
      continue;
    }
    if (auto it = by_fn.find(e.fn); it != by_fn.end()) {
      plans[it->second].real_slots.push_back(e.real_slot);
      continue;
    }
    const procfs::Mapping* m = nullptr;
    for (const auto& mm : *maps)
      if (e.fn >= mm.start && e.fn < mm.end) m = &mm;
    if (!m || !m->file() || !m->exec()) {
      rep.refused.push_back(name + ": its entry " + hex(e.fn) + " is in no executable file mapping");
      continue;
    }
    std::string why;
    EntryFiles::File* file = files->get(pid, *m, &why);
    if (!file) {
      rep.refused.push_back(name + ": " + why);
      continue;
    }
    const auto& elf = file->elf;
    uint64_t file_off = m->offset + (e.fn - m->start);
    const elf::Symbol* sym = nullptr;
    for (const auto& s : elf->symbols())
      if ((s.type == STT_FUNC || s.type == STT_GNU_IFUNC) && s.file_offset == file_off && s.size) {
        sym = &s;
        break;
      }
    if (!sym) {
      rep.refused.push_back(name + ": no function symbol of " + m->path + " at its entry");
      continue;
    }
    size_t body = std::min<uint64_t>(sym->size, 64 * 1024);
    std::vector<uint8_t> code = elf->read_vaddr(sym->vaddr, std::max<size_t>(body, 64));
    if (code.size() < 16) {
      rep.refused.push_back(name + ": its code could not be read from " + m->path);
      continue;
    }
    Plan p;
    p.index = i;
    p.name = name;
    p.fn = e.fn;
    p.hook = e.hook;
    p.stub = tramp + uint64_t{i} * MT_INJ_TRAMP_SLOT;
    // The object's rel32 branches that land in this entry's first bytes.
    const auto& all = file->targets;
    std::vector<uint64_t> incoming;
    for (auto it = std::upper_bound(all.begin(), all.end(), sym->vaddr); it != all.end() && *it <= sym->vaddr + kOrigMax; ++it)
      if (incoming.empty() || incoming.back() != *it - sym->vaddr) incoming.push_back(*it - sym->vaddr);
    // The first instruction kept, and every probe offset the jmp and the
    // bytes relocated with it would cover: until none is.
    Result<Relocated> rel = Error::msg("not relocated");
    bool kept = true;
    for (int verified = 0; verified < 2; verified++) {
      if (verified) {
        // Refused for a branch the byte scan found: only those that are
        // instructions of their functions (an executable with jemalloc
        // linked in had a false one into calloc).
        if (rel || rel.error().message.find("a branch elsewhere in its object") == std::string::npos) break;
        std::vector<uint64_t> real;
        for (uint64_t t : incoming)
          if (really_branches_to(*elf, sym->vaddr + t)) real.push_back(t);
        if (real.size() == incoming.size()) break;
        incoming = std::move(real);
      }
      uint64_t upto = 1;
      for (int pass = 0; pass < 8; pass++) {
        if (auto k = keep_probed(code, e.fn, *elf, *sym, e.role, &p, upto); !k) {
          if (!p.thunk) rep.refused.push_back(name + ": " + k.error().message);
          kept = false;
          break;
        }
        rel = relocate_prologue(code, body, e.fn, p.stub, p.keep + kJmpLen, incoming);
        if (!rel) break;
        uint64_t end = rel->len;
        bool covered = false;
        for (uint64_t x : p.probes) covered |= x >= upto && x < end;
        if (!covered) break;
        upto = end;
      }
      if (!kept) break;
    }
    if (!kept) continue;
    if (!rel) {
      rep.refused.push_back(name + ": " + rel.error().message);
      continue;
    }
    if (rel->code.size() > MT_INJ_TRAMP_SLOT) {
      rep.refused.push_back(name + ": its relocated first instructions take " + std::to_string(rel->code.size()) +
                            " bytes, more than a stub's " + std::to_string(MT_INJ_TRAMP_SLOT));
      continue;
    }
    if (rel->len > kOrigMax || p.glue.size() + 14 > 64) {
      rep.refused.push_back(name + ": " + std::to_string(rel->len) + " bytes to relocate, more than " +
                            std::to_string(kOrigMax));
      continue;
    }
    auto isl = island_for(tramp, i, e.fn + p.keep);
    if (!isl) {
      rep.refused.push_back(name + ": no jump to the trampoline area without a 0xcc byte");
      continue;
    }
    p.island = *isl;
    p.len = rel->len;
    p.stub_code = std::move(rel->code);
    p.orig.assign(code.begin(), code.begin() + static_cast<long>(p.len));
    p.real_slots = {e.real_slot};
    p.orig_slot = e.orig_slot;
    by_fn[e.fn] = plans.size();
    plans.push_back(std::move(p));
  }
  if (plans.empty()) return rep;

  Fd mem(open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDWR | O_CLOEXEC));
  if (!mem.valid()) return Error::sys("open /proc/" + std::to_string(pid) + "/mem");
  auto t0 = std::chrono::steady_clock::now();
  bool written = false;
  std::string busy;
  for (int attempt = 0; attempt < 50 && !written; attempt++) {
    if (attempt) {
      // The others run a little (held's first thread, the call's, stays).
      if (held) release_others(*held);
      std::this_thread::sleep_for(std::chrono::microseconds(500 + 100 * attempt));
    }
    rep.thread_stops++;
    auto r = with_threads_stopped(pid, held, [&](const std::vector<pid_t>& tids) -> Result<void> {
      for (pid_t t : tids)
        if (inside(t, mem.get(), plans)) {
          busy = "thread " + std::to_string(t);
          return {};
        }
      // The entry as the file has it (a uprobe's 0xcc aside): nothing else
      // has patched it.
      for (auto& p : plans) {
        if (p.len == 0) continue;  // an alias patched before
        std::vector<uint8_t> now(p.len);
        if (pread(mem.get(), now.data(), now.size(), static_cast<off_t>(p.fn)) != static_cast<ssize_t>(now.size())) {
          rep.refused.push_back(p.name + ": its entry could not be read");
          p.real_slots.clear();
          continue;
        }
        for (size_t k = 0; k < p.len; k++)
          if (now[k] != p.orig[k] && now[k] != 0xcc) {
            rep.refused.push_back(p.name + ": its entry differs from the file's at +" + hex(k) + " (patched by something else)");
            p.real_slots.clear();
            break;
          }
      }
      for (auto& p : plans) {
        if (p.real_slots.empty()) continue;
        if (p.len) {
          // The replaced bytes, for a fork's child to put back (agent.c).
          uint8_t orig[kOrigBytes] = {0};
          memcpy(orig, p.orig.data(), p.len);
          orig[kOrigMax] = static_cast<uint8_t>(p.len);
          memcpy(orig + kOrigMax + 1, p.orig.data(), p.len);
          memcpy(orig + kOrigMax + 1 + p.keep, jmp_of(p).data(), kJmpLen);
          if (p.orig_slot)
            if (auto w = mem_write(mem.get(), p.orig_slot, orig, sizeof orig); !w) return w.error();
          // The kept instructions undone, then jmp [rip+0]; .quad hook.
          std::vector<uint8_t> island = p.glue;
          for (uint8_t b : {0xff, 0x25, 0, 0, 0, 0}) island.push_back(b);
          island.resize(island.size() + 8);
          memcpy(island.data() + island.size() - 8, &p.hook, 8);
          if (auto w = mem_write(mem.get(), p.stub, p.stub_code.data(), p.stub_code.size()); !w) return w.error();
          if (auto w = mem_write(mem.get(), p.island, island.data(), island.size()); !w) return w.error();
        }
        for (uint64_t slot : p.real_slots)
          if (auto w = mem_write(mem.get(), slot, &p.stub, 8); !w) return w.error();
        if (p.len) {
          auto jmp = jmp_of(p);
          if (auto w = mem_write(mem.get(), p.fn + p.keep, jmp.data(), jmp.size()); !w) return w.error();
          rep.patched++;
        }
        __atomic_store_n(&hdr->entries[p.index].stub, p.stub, __ATOMIC_RELEASE);
      }
      written = true;
      return {};
    });
    if (!r) return Error{"patching the allocator's entries: " + r.error().message, r.error().err};
  }
  rep.stopped_us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
  if (!written) {
    for (const auto& p : plans) rep.refused.push_back(p.name + ": a thread stayed inside its first bytes (" + busy + ")");
  }
  hdr->entries_patched = rep.patched + rep.already;
  return rep;
}

Result<uint32_t> unpatch_entries(pid_t pid, mt_inj_hdr* hdr) {
  uint32_t count = std::min<uint32_t>(__atomic_load_n(&hdr->entry_count, __ATOMIC_ACQUIRE), MT_INJ_ENTRY_MAX);
  uint64_t tramp = hdr->tramp;
  bool any = false;
  for (uint32_t i = 0; i < count; i++) any |= hdr->entries[i].stub != 0;
  if (!any) return 0u;
  std::string who = "pid " + std::to_string(pid);
  if (!tramp) return Error::msg(who + ": entries patched but no trampoline area recorded");
  if (!agent_mapped(pid)) return Error::msg(who + ": the agent is not mapped any more");
  // The trampoline area still there: the same image as the agent's.
  auto maps = procfs::read_maps(pid);
  if (!maps) return maps.error();
  bool area = false;
  for (const auto& m : *maps) area |= m.start <= tramp && tramp < m.end && m.exec() && !m.file();
  if (!area) return Error::msg(who + ": the trampoline area at " + hex(tramp) + " is not mapped any more");
  Fd mem(open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDWR | O_CLOEXEC));
  if (!mem.valid()) return Error::sys("open /proc/" + std::to_string(pid) + "/mem");
  uint32_t put_back = 0;
  auto r = with_threads_stopped(pid, nullptr, [&](const std::vector<pid_t>&) -> Result<void> {
    for (uint32_t i = 0; i < count; i++) {
      auto& e = hdr->entries[i];
      if (!e.stub) continue;
      uint8_t orig[kOrigBytes] = {0};
      if (pread(mem.get(), orig, sizeof orig, static_cast<off_t>(e.orig_slot)) != static_cast<ssize_t>(sizeof orig)) continue;
      size_t n = orig[kOrigMax];
      if (n) {
        if (n < kJmpLen || n > kOrigMax) continue;
        uint8_t now[kOrigMax];
        if (pread(mem.get(), now, n, static_cast<off_t>(e.fn)) != static_cast<ssize_t>(n)) continue;
        // As patched, or as the file has them (put back already: a restore
        // ended between two entries, or another tool's), but for a
        // uprobe's int3 on any byte.
        bool ours = true, original = true;
        for (size_t k = 0; k < n; k++) {
          ours &= now[k] == orig[kOrigMax + 1 + k] || now[k] == 0xcc;
          original &= now[k] == orig[k] || now[k] == 0xcc;
        }
        if (!ours && !original) continue;
        if (!original) {
          for (size_t k = 0; k < n; k++)
            if (now[k] != 0xcc) now[k] = orig[k];  // a uprobe's int3 stays, on the original instruction
          if (!mem_write(mem.get(), e.fn, now, n)) continue;
        }
        put_back++;
      }
      // Its pointer (and its aliases') to the original itself again: the
      // agent lists it as not patched to the next session.
      for (uint32_t j = 0; j < count; j++)
        if (hdr->entries[j].fn == e.fn && hdr->entries[j].real_slot) {
          uint64_t fn = e.fn;
          (void)mem_write(mem.get(), hdr->entries[j].real_slot, &fn, 8);
          if (j != i) __atomic_store_n(&hdr->entries[j].stub, uint64_t{0}, __ATOMIC_RELEASE);
        }
      __atomic_store_n(&e.stub, uint64_t{0}, __ATOMIC_RELEASE);
    }
    return {};
  });
  if (!r) return r.error();
  return put_back;
}
#endif

}  // namespace memtrace::inject
