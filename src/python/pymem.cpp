// pymalloc in a process: its allocator structs read from the exported
// wrappers' code, the functions they point to, where to probe them (see
// pymem.h).
#include "python/pymem.h"

#include <capstone/capstone.h>
#include <elf.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "elf/elf_file.h"
#include "memtrace.h"
#include "probes/allocators.h"
#include "unwind/cfi_table.h"

namespace memtrace::python {
namespace {

// What a wrapper's first instructions load RIP-relative (mov reg, [rip+d])
// and the constants it compares with or takes the address of (cmp reg, imm;
// lea reg, [rip+d]): the struct's slots, and a PGO-promoted call's target.
struct WrapperRefs {
  std::set<uint64_t> loads, constants;
};

WrapperRefs read_wrapper(const elf::ElfFile& elf, const std::string& name) {
  WrapperRefs r;
  auto sym = elf.find_function(name);
  if (!sym) return r;
  uint64_t len = sym->size ? std::min<uint64_t>(sym->size, 96) : 96;
  std::vector<uint8_t> code = elf.read_vaddr(sym->vaddr, len);
  csh h;
  if (cs_open(CS_ARCH_X86, CS_MODE_64, &h) != CS_ERR_OK) return r;
  cs_option(h, CS_OPT_DETAIL, CS_OPT_ON);
  cs_insn* insn = nullptr;
  size_t n = cs_disasm(h, code.data(), code.size(), sym->vaddr, 16, &insn);
  for (size_t i = 0; i < n; i++) {
    const cs_insn& in = insn[i];
    const cs_x86& x = in.detail->x86;
    for (int k = 0; k < x.op_count; k++) {
      const cs_x86_op& op = x.operands[k];
      if (op.type == X86_OP_MEM && op.mem.base == X86_REG_RIP && op.mem.index == X86_REG_INVALID) {
        uint64_t a = in.address + in.size + op.mem.disp;
        if (in.id == X86_INS_MOV && k == 1 && op.size == 8) r.loads.insert(a);
        if (in.id == X86_INS_LEA) r.constants.insert(a);
      }
      if (op.type == X86_OP_IMM && in.id == X86_INS_CMP) r.constants.insert(static_cast<uint64_t>(op.imm) & 0xffffffffull);
    }
  }
  if (n) cs_free(insn, n);
  cs_close(&h);
  return r;
}

// The struct whose slot at byte `slot` a wrapper loads beside its ctx (slot 0).
std::optional<uint64_t> struct_base(const WrapperRefs& r, uint64_t slot) {
  for (uint64_t a : r.loads)
    if (r.loads.count(a + slot)) return a;
  return std::nullopt;
}

// Function ranges from the CFI (the binary is stripped: static functions
// have no symbol), sorted by start.
using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

const std::pair<uint64_t, uint64_t>* range_of(const Ranges& fdes, uint64_t a) {
  auto it = std::upper_bound(fdes.begin(), fdes.end(), std::make_pair(a, ~uint64_t(0)));
  if (it == fdes.begin()) return nullptr;
  --it;
  return a >= it->first && a < it->second ? &*it : nullptr;
}

// Is `at` the start of an instruction of the function (FDE) holding it?
bool on_boundary(const elf::ElfFile& elf, const Ranges& fdes, uint64_t at) {
  const auto* r = range_of(fdes, at);
  if (!r || r->second - r->first > (1u << 20)) return false;
  std::vector<uint8_t> code = elf.read_vaddr(r->first, r->second - r->first);
  csh h;
  if (cs_open(CS_ARCH_X86, CS_MODE_64, &h) != CS_ERR_OK) return false;
  const uint8_t* p = code.data();
  size_t left = code.size();
  uint64_t addr = r->first;
  cs_insn* insn = cs_malloc(h);
  bool ok = false;
  while (addr < at && cs_disasm_iter(h, &p, &left, &addr, insn)) {
  }
  ok = addr == at;
  cs_free(insn, 1);
  cs_close(&h);
  return ok;
}

// A `jmp target` (e9 rel32) at an instruction boundary of the file's code:
// the same function reached under another address.
std::optional<uint64_t> find_jmp_to(const elf::ElfFile& elf, const Ranges& fdes, uint64_t target) {
  for (const auto& seg : elf.segments()) {
    if (!(seg.flags & PF_X) || seg.filesz < 5) continue;
    std::vector<uint8_t> b = elf.read_vaddr(seg.vaddr, seg.filesz);
    for (size_t p = 0; p + 5 <= b.size(); p++) {
      if (b[p] != 0xe9) continue;
      int32_t rel;
      memcpy(&rel, &b[p + 1], 4);
      uint64_t at = seg.vaddr + p;
      if (at + 5 + static_cast<int64_t>(rel) == target && on_boundary(elf, fdes, at)) return at;
    }
  }
  return std::nullopt;
}

// Copies of a PGO-promoted call to target inlined at its sites: compares of
// a register with target as an imm32 (cmp rax, imm: 48 3d; cmp r64, imm:
// 48/49 81 f8+r). An estimate for the note (bytes, not decoded).
uint32_t promoted_sites(const elf::ElfFile& elf, uint64_t target) {
  if (target >> 31) return 0;
  uint32_t n = 0, t = static_cast<uint32_t>(target);
  for (const auto& seg : elf.segments()) {
    if (!(seg.flags & PF_X) || seg.filesz < 6) continue;
    std::vector<uint8_t> b = elf.read_vaddr(seg.vaddr, seg.filesz);
    for (size_t p = 2; p + 4 <= b.size(); p++) {
      uint32_t v;
      memcpy(&v, &b[p], 4);
      if (v != t) continue;
      if (b[p - 1] == 0x3d && (b[p - 2] & 0xf8) == 0x48) n++;
      else if (p >= 3 && (b[p - 1] & 0xf8) == 0xf8 && b[p - 2] == 0x81 && (b[p - 3] & 0xf8) == 0x48) n++;
    }
  }
  return n;
}

bool read_mem(pid_t pid, uint64_t addr, void* out, size_t len) {
  iovec local{out, len}, remote{reinterpret_cast<void*>(addr), len};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(len);
}

std::string hex(uint64_t v) {
  char b[24];
  snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

}  // namespace

std::optional<PyMem> find_pymalloc(pid_t pid, const Interpreter& in, const std::vector<procfs::Mapping>& maps,
                                   std::string* why, const std::string& root) {
  auto fail = [&](std::string s) -> std::optional<PyMem> {
    if (why) *why = std::move(s);
    return std::nullopt;
  };
  if (in.major != 3 || in.minor != 11) return fail("CPython " + in.version() + ": the python domain needs 3.11");
  auto elf = elf::ElfFile::open(root + in.path);
  if (!elf) return fail("open " + in.path + ": " + elf.error().message);
  auto rt = elf->find_object("_PyRuntime");
  if (!rt) return fail(in.path + " has no _PyRuntime");
  const uint64_t bias = in.runtime - rt->vaddr;

  // The structs: _PyObject from PyObject_Malloc (ctx, malloc at +8) and
  // PyObject_Free (free at +32); _PyMem from PyMem_Malloc; _PyMem_Raw from
  // PyMem_RawMalloc.
  WrapperRefs om = read_wrapper(*elf, "PyObject_Malloc"), of = read_wrapper(*elf, "PyObject_Free");
  WrapperRefs mm = read_wrapper(*elf, "PyMem_Malloc"), rm = read_wrapper(*elf, "PyMem_RawMalloc");
  WrapperRefs oc = read_wrapper(*elf, "PyObject_Calloc"), orr = read_wrapper(*elf, "PyObject_Realloc");
  auto obj = struct_base(om, 8), obj_f = struct_base(of, 32), mem = struct_base(mm, 8), raw = struct_base(rm, 8);
  if (!obj || !obj_f || *obj != *obj_f || !raw)
    return fail("the allocator structs of " + in.path + " were not found in PyObject_Malloc's code");
  uint64_t o[5], r[5], m[5] = {};
  if (!read_mem(pid, *obj + bias, o, sizeof o) || !read_mem(pid, *raw + bias, r, sizeof r) ||
      (mem && !read_mem(pid, *mem + bias, m, sizeof m)))
    return fail("read the allocator structs of pid " + std::to_string(pid) + ": " + strerror(errno));
  if (o[1] == r[1]) return fail("PyObject_Malloc is the raw allocator (PYTHONMALLOC=malloc): no python domain");
  auto in_text = [&](uint64_t a) {
    for (const auto& mp : maps)
      if (mp.exec() && mp.path == in.path && a >= mp.start && a < mp.end) return true;
    return false;
  };
  for (int i = 1; i < 5; i++)
    if (!in_text(o[i]))
      return fail("PyObject allocator slot " + std::to_string(i) + " = " + hex(o[i]) + " is outside " + in.path +
                  "'s code: no python domain");

  Ranges fdes;
  if (auto cfi = unwind::build_cfi_table(root + in.path)) fdes = cfi->fde_ranges;
  std::sort(fdes.begin(), fdes.end());

  PyMem pm;
  pm.path = in.path;
  static const char* names[] = {"_PyObject_Malloc", "_PyObject_Calloc", "_PyObject_Realloc", "_PyObject_Free"};
  static const uint32_t roles[] = {MT_ROLE_PY_MALLOC, MT_ROLE_PY_CALLOC, MT_ROLE_PY_REALLOC, MT_ROLE_PY_FREE};
  std::string note;
  for (int i = 0; i < 4; i++) {
    const uint64_t f = o[i + 1] - bias;  // the function, in the file
    const auto role = static_cast<probes::Role>(roles[i]);
    probes::Needs needs = probes::needs_for(role);
    elf::Symbol sym;
    sym.name = names[i];
    sym.vaddr = f;
    if (const auto* rg = range_of(fdes, f); rg && rg->first == f) sym.size = rg->second - rg->first;
    probes::Placement own = probes::place_function(*elf, sym, needs);
    const bool own_cheap = own.emulated && (!needs.return_probe || probes::return_probe_offset(own) == own.offset);
    // Promoted and inlined where the wrapper compares with it: those
    // copies run unless the slot holds another address.
    bool promoted = false;
    for (const WrapperRefs* w : {&om, &of, &mm, &oc, &orr}) promoted |= w->constants.count(f) != 0;
    // 0: none (a plain value: gcc 12 sees an optional's copies as maybe uninitialized)
    const uint64_t jmp = promoted ? find_jmp_to(*elf, fdes, f).value_or(0) : 0;
    if (jmp) {
      for (auto base : {obj, mem})
        if (base) {
          const uint64_t* s = base == obj ? o : m;
          if (s[i + 1] == o[i + 1]) pm.slots.push_back({*base + bias + 8 * (i + 1), o[i + 1], jmp + bias});
        }
    } else if (promoted) {
      pm.inlined_sites += promoted_sites(*elf, f);
    }
    PyMemSite site;
    site.role = roles[i];
    if (own_cheap || !jmp) {
      site.name = names[i];
      site.vaddr = f;
      site.placement = own;
    } else {
      // The jmp: emulated, the return address at [rsp] (entry and return probe on one trap).
      site.name = std::string("jmp ") + names[i] + " at " + hex(jmp);
      site.vaddr = jmp;
      std::vector<uint8_t> code = elf->read_vaddr(jmp, 16);
      site.placement = probes::choose_entry_offset(code, jmp, needs);
    }
    auto off = elf->vaddr_to_offset(site.vaddr);
    if (!off) return fail(std::string(names[i]) + " at " + hex(f) + " is in no segment of " + in.path);
    site.file_offset = *off;
    note += std::string(i ? ", " : "") + names[i] + " " + hex(f) + (jmp ? " via " + hex(jmp) : "") + " probed at " +
            site.name + "+" + std::to_string(site.placement.offset);
    pm.sites.push_back(std::move(site));
  }
  pm.note = "pymalloc (python domain): " + note;
  if (pm.inlined_sites) pm.note += "; " + std::to_string(pm.inlined_sites) + " inlined copies unseen";
  return pm;
}

bool write_slots(pid_t pid, const std::vector<PyMemSlot>& slots, bool restore, std::string* err) {
  for (const PyMemSlot& s : slots) {
    uint64_t want = restore ? s.was : s.now, expect = restore ? s.now : s.was, cur = 0;
    if (!read_mem(pid, s.addr, &cur, 8)) {
      if (err) *err = "read " + hex(s.addr) + " of pid " + std::to_string(pid) + ": " + strerror(errno);
      return false;
    }
    if (cur != expect) continue;  // the program changed it (PyMem_SetAllocator): left alone
    iovec local{&want, 8}, remote{reinterpret_cast<void*>(s.addr), 8};
    if (process_vm_writev(pid, &local, 1, &remote, 1, 0) != 8) {
      if (err) *err = "write " + hex(s.addr) + " of pid " + std::to_string(pid) + ": " + strerror(errno);
      return false;
    }
  }
  return true;
}

}  // namespace memtrace::python
