#include "python/python.h"

#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "elf/elf_file.h"
#include "memtrace.h"
#include "unwind/cfi_table.h"

namespace memtrace::python {

namespace {

// 3.11 (Include/internal/pycore_frame.h, pycore_runtime.h, cpython/code.h,
// cpython/pystate.h of 3.11.2; measured on Debian 12's python3.11).
constexpr Layout k311 = [] {
  Layout l;
  l.major = 3;
  l.minor = 11;
  l.runtime_tss = 592;
  l.tstate_cframe = 56;
  l.cframe_current = 8;
  l.frame_code = 32;
  l.frame_previous = 48;
  l.frame_prev_instr = 56;
  l.frame_is_entry = 68;
  l.co_firstlineno = 72;
  l.co_filename = 112;
  l.co_name = 120;
  l.co_qualname = 128;
  l.co_linetable = 136;
  l.co_code_units = 184;
  return l;
}();

std::string base_name(const std::string& p) {
  auto s = p.rfind('/');
  return s == std::string::npos ? p : p.substr(s + 1);
}

// "python3.11" / "libpython3.11.so.1.0" / "python3.11d": (3, 11)
bool version_from_name(const std::string& name, int* major, int* minor) {
  auto at = name.find("python");
  if (at == std::string::npos) return false;
  return sscanf(name.c_str() + at + 6, "%d.%d", major, minor) == 2;
}

}  // namespace

const Layout* layout_for(int major, int minor) {
  if (major == 3 && minor == 11) return &k311;
  return nullptr;
}

// _Py_DebugOffsets of 3.13 (Include/internal/pycore_runtime.h of 3.13.5):
// cookie, version, free_threaded, then groups of uint64 offsets, each group's
// first the struct's size. Byte positions in the structure:
//   24 runtime_state(3) 48 interpreter_state(13) 152 thread_state(9)
//   224 interpreter_frame(6) 272 code_object(10) 352 pyobject(2) 368 type(4)
//   400 tuple(3) 424 list(3) 448 dict(3) 472 float(2) 488 long(3)
//   512 bytes(3) 536 unicode(4) 568 gc(2): 584 bytes.
Result<Layout> layout_from_debug_offsets(const std::vector<uint8_t>& b, uint64_t runtime_size) {
  if (b.size() < 584) return Error::msg("_PyRuntime unreadable");
  if (memcmp(b.data(), "xdebugpy", 8) != 0) return Error::msg("no _Py_DebugOffsets at the start of _PyRuntime");
  auto u = [&](size_t at) {
    uint64_t v;
    memcpy(&v, b.data() + at, 8);
    return v;
  };
  uint64_t version = u(8);
  if ((version >> 16) != 0x030d)
    return Error::msg("_Py_DebugOffsets of version " + std::to_string(version >> 24) + "." +
                      std::to_string((version >> 16) & 0xff) + ": only 3.13's structure is read");
  if (u(16) != 0) return Error::msg("a free-threaded build");
  // The groups' sizes and the fixed offsets of str and bytes check that this
  // is the structure read here (a shifted group reads other numbers).
  if (u(24) != runtime_size || u(512 + 8) != 16 || u(512 + 16) != 32 || u(536 + 16) != 16 || u(352) != 16 ||
      u(536 + 24) < 32 || u(536 + 24) > 64)
    return Error::msg("_Py_DebugOffsets not laid out as 3.13's");
  auto off16 = [&](size_t at) -> std::optional<uint16_t> {
    uint64_t v = u(at);
    if (v > 0xffff) return std::nullopt;
    return static_cast<uint16_t>(v);
  };
  Layout l;
  l.major = 3;
  l.minor = 13;
  l.from_debug_offsets = true;
  l.no_cframe = true;
  auto cur = off16(152 + 32), fsize = off16(224), prev = off16(224 + 8), exe = off16(224 + 16),
       instr = off16(224 + 24), owner = off16(224 + 40);
  if (!cur || !fsize || !prev || !exe || !instr || !owner || *fsize > 256)
    return Error::msg("_Py_DebugOffsets' thread state or frame offsets out of range");
  l.tstate_cframe = *cur;
  l.frame_code = *exe;
  l.frame_previous = *prev;
  l.frame_prev_instr = *instr;
  l.frame_owner = *owner;
  l.owner_cstack = 3;  // FRAME_OWNED_BY_CSTACK (3.13's pycore_frame.h)
  l.co_filename = static_cast<uint32_t>(u(272 + 8));
  l.co_name = static_cast<uint32_t>(u(272 + 16));
  l.co_qualname = static_cast<uint32_t>(u(272 + 24));
  l.co_linetable = static_cast<uint32_t>(u(272 + 32));
  l.co_firstlineno = static_cast<uint32_t>(u(272 + 40));
  l.co_code_units = static_cast<uint32_t>(u(272 + 72));
  for (uint32_t o : {l.co_filename, l.co_name, l.co_qualname, l.co_linetable, l.co_firstlineno, l.co_code_units})
    if (o == 0 || o > u(272)) return Error::msg("_Py_DebugOffsets' code object offsets out of range");
  l.bytes_size = static_cast<uint32_t>(u(512 + 8));
  l.bytes_data = static_cast<uint32_t>(u(512 + 16));
  l.str_state = static_cast<uint32_t>(u(536 + 8));
  l.str_length = static_cast<uint32_t>(u(536 + 16));
  l.str_ascii_data = static_cast<uint32_t>(u(536 + 24));
  // PyCompactUnicodeObject: the ASCII header, utf8_length and utf8 (3.12+)
  l.str_compact_data = l.str_ascii_data + 16;
  return l;
}

std::optional<int32_t> tls_offset_from_code(const std::vector<uint8_t>& c) {
  size_t i = 0;
  if (c.size() >= 4 && c[0] == 0xf3 && c[1] == 0x0f && c[2] == 0x1e && c[3] == 0xfa) i = 4;  // endbr64
  // mov %fs:disp32,%rax (64 48 8b 04 25 disp32), then ret
  static const uint8_t mov[] = {0x64, 0x48, 0x8b, 0x04, 0x25};
  if (c.size() < i + 10 || memcmp(&c[i], mov, sizeof mov) != 0 || c[i + 9] != 0xc3) return std::nullopt;
  int32_t off;
  memcpy(&off, &c[i + 5], 4);
  if (off >= 0 || off < -(1 << 20)) return std::nullopt;  // variant II: below the thread pointer
  return off;
}

std::optional<uint32_t> tss_offset_from_code(const std::vector<uint8_t>& c, uint64_t vaddr, uint64_t runtime,
                                             uint64_t runtime_size) {
  size_t i = 0;
  if (c.size() >= 4 && c[0] == 0xf3 && c[1] == 0x0f && c[2] == 0x1e && c[3] == 0xfa) i = 4;  // endbr64
  // cmpl $0x0,disp32(%rip): 83 3d disp32 00; mov disp32(%rip),%edi: 8b 3d disp32
  if (c.size() < i + 13 || c[i] != 0x83 || c[i + 1] != 0x3d || c[i + 6] != 0x00) return std::nullopt;
  int32_t d1, d2;
  memcpy(&d1, &c[i + 2], 4);
  uint64_t key = vaddr + i + 7 + int64_t{d1};
  size_t j = i + 7;
  // (a jump to the not-initialized path may come between: je rel32 / rel8)
  if (c.size() >= j + 6 && c[j] == 0x0f && c[j + 1] == 0x84) j += 6;
  else if (c.size() >= j + 2 && c[j] == 0x74) j += 2;
  if (c.size() < j + 6 || c[j] != 0x8b || c[j + 1] != 0x3d) return std::nullopt;
  memcpy(&d2, &c[j + 2], 4);
  if (vaddr + j + 6 + int64_t{d2} != key + 4) return std::nullopt;  // its _key: the same structure
  if (key < runtime || key + 8 > runtime + runtime_size) return std::nullopt;
  return static_cast<uint32_t>(key - runtime);
}

Result<Mode> parse_mode(const std::string& s) {
  if (s == "off") return Mode::Off;
  if (s == "on") return Mode::On;
  if (s == "only") return Mode::Only;
  return Error::msg("--python-frames " + s + ": expected off, on or only");
}

bool Interpreter::in_eval(uint64_t ra) const {
  uint64_t pc = ra - 1;
  for (const auto& [lo, hi] : eval)
    if (pc >= lo && pc < hi) return true;
  return false;
}

std::string Interpreter::version() const {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(micro);
}

std::vector<std::pair<uint64_t, uint64_t>> cold_parts(const std::string& path, uint64_t hot_lo, uint64_t hot_hi) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  auto cfi = unwind::build_cfi_table(path);
  auto elf = elf::ElfFile::open(path);
  if (!cfi || !elf) return out;
  std::vector<std::pair<uint64_t, uint64_t>> named;
  for (const auto& s : elf->symbols())
    if (s.size && (s.type == 2 /*STT_FUNC*/ || s.type == 10 /*STT_GNU_IFUNC*/)) named.emplace_back(s.vaddr, s.vaddr + s.size);
  std::sort(named.begin(), named.end());
  auto covered = [&](uint64_t lo, uint64_t hi) {
    auto it = std::upper_bound(named.begin(), named.end(), std::make_pair(lo, ~uint64_t(0)));
    if (it != named.begin() && std::prev(it)->second > lo) return true;
    return it != named.end() && it->first < hi;
  };
  std::vector<std::pair<uint64_t, uint64_t>> unnamed;
  for (const auto& r : cfi->fde_ranges)
    if (!(r.first < hot_hi && r.second > hot_lo) && !covered(r.first, r.second)) unnamed.push_back(r);
  if (unnamed.empty()) return out;
  // Direct jumps, at every byte position: jmp rel32 (e9), jcc rel32 (0f 80..8f).
  auto jumps = [&](uint64_t lo, uint64_t hi, const std::function<void(uint64_t)>& to) {
    std::vector<uint8_t> code = elf->read_vaddr(lo, hi - lo);
    for (size_t i = 0; i + 5 <= code.size(); i++) {
      int32_t rel;
      if (code[i] == 0xe9) {
        memcpy(&rel, &code[i + 1], 4);
        to(lo + i + 5 + int64_t{rel});
      } else if (code[i] == 0x0f && i + 6 <= code.size() && (code[i + 1] & 0xf0) == 0x80) {
        memcpy(&rel, &code[i + 2], 4);
        to(lo + i + 6 + int64_t{rel});
      }
    }
  };
  std::vector<int> into(unnamed.size());
  jumps(hot_lo, hot_hi, [&](uint64_t to) {
    auto it = std::upper_bound(unnamed.begin(), unnamed.end(), std::make_pair(to, ~uint64_t(0)));
    if (it == unnamed.begin()) return;
    --it;
    if (to >= it->first && to < it->second) into[it - unnamed.begin()]++;
  });
  // A .cold part is jumped into from the function and jumps back into it
  // (a byte position misread as a jump lands in some other code now and
  // then, both ways hardly ever: the test checks the result against the
  // debug file's .cold symbol).
  for (size_t i = 0; i < unnamed.size(); i++) {
    if (into[i] < 2) continue;
    int back = 0;
    jumps(unnamed[i].first, unnamed[i].second, [&](uint64_t to) { back += to >= hot_lo && to < hot_hi; });
    if (back >= 2) out.push_back(unnamed[i]);
  }
  return out;
}

Detected detect(const std::vector<procfs::Mapping>& maps, const std::string& root) {
  Detected d;
  for (const auto& m : maps) {
    if (!m.exec() || !m.file() || base_name(m.path).find("python") == std::string::npos) continue;
    std::string path = root + m.path;
    auto elf = elf::ElfFile::open(path);
    if (!elf) continue;
    auto eval = elf->find_function("_PyEval_EvalFrameDefault");
    auto runtime = elf->find_object("_PyRuntime");
    auto code_type = elf->find_object("PyCode_Type");
    if (!eval || !runtime || !code_type) continue;
    // Load bias from this mapping: the PT_LOAD holding its file offset.
    uint64_t bias = 0;
    bool found = false;
    for (const auto& s : elf->segments())
      if (m.offset >= (s.offset & ~uint64_t(0xfff)) && m.offset < s.offset + s.filesz) {
        bias = m.start - (m.offset - s.offset + s.vaddr) ;
        bias &= ~uint64_t(0xfff);
        if (elf->type() == 2 /*ET_EXEC*/) bias = 0;
        found = true;
        break;
      }
    if (!found) continue;
    Interpreter in;
    in.path = m.path;
    if (auto v = elf->find_object("Py_Version")) {
      auto b = elf->read_vaddr(v->vaddr, 4);
      if (b.size() == 4) {
        uint32_t hex;
        memcpy(&hex, b.data(), 4);
        in.major = hex >> 24;
        in.minor = (hex >> 16) & 0xff;
        in.micro = (hex >> 8) & 0xff;
      }
    }
    if (!in.major && !version_from_name(base_name(m.path), &in.major, &in.minor)) continue;
    if (in.major == 3 && in.minor == 13) {
      // The layout the interpreter publishes, and where its thread state lives.
      auto unsupported = [&](const std::string& why) {
        d.unsupported = "CPython " + in.version() + " (" + m.path + "): " + why + "; native stacks only";
        return d;
      };
      auto l = layout_from_debug_offsets(elf->read_vaddr(runtime->vaddr, 584), runtime->size);
      if (!l) return unsupported(l.error().message);
      auto get = elf->find_function("_PyThreadState_GetCurrent");
      std::optional<int32_t> tls;
      if (get) tls = tls_offset_from_code(elf->read_vaddr(get->vaddr, 16));
      if (!tls) return unsupported("its thread state is not a TLS variable of the executable (a shared libpython)");
      in.layout = *l;
      in.layout.tstate_tls = *tls;
      if (auto gs = elf->find_function("PyGILState_GetThisThreadState"))
        if (auto off = tss_offset_from_code(elf->read_vaddr(gs->vaddr, 32), gs->vaddr, runtime->vaddr, runtime->size))
          in.layout.runtime_tss = *off;
    } else {
      const Layout* l = layout_for(in.major, in.minor);
      if (!l) {
        d.unsupported = "CPython " + in.version() + " (" + m.path + ") is not supported: Python frames need 3.11 or 3.13; native stacks only";
        return d;
      }
      in.layout = *l;
    }
    // PyCode_Type as the file initializes it (static data: what the process
    // has too, before and after it runs): tp_basicsize, and in a file not
    // relocated at load (ET_EXEC) its member table's offsets.
    if (in.layout.from_debug_offsets) {
      // the structure's offsets are the interpreter's own
    } else if (auto b = elf->read_vaddr(code_type->vaddr + 32, 8); b.size() == 8) {
      int64_t basic;
      memcpy(&basic, b.data(), 8);
      if (basic > 0 && basic < 4096) in.layout.co_code_units = static_cast<uint32_t>(basic);
    }
    if (elf->type() == 2 /*ET_EXEC*/ && !in.layout.from_debug_offsets)
      if (auto b = elf->read_vaddr(code_type->vaddr + 240, 8); b.size() == 8) {
        uint64_t members;
        memcpy(&members, b.data(), 8);
        for (int i = 0; members && i < 64; i++) {
          auto def = elf->read_vaddr(members + i * 40, 40);
          if (def.size() != 40) break;
          uint64_t name_p;
          int64_t off;
          memcpy(&name_p, def.data(), 8);
          memcpy(&off, def.data() + 16, 8);
          if (!name_p) break;
          auto nb = elf->read_vaddr(name_p, 32);
          std::string n(reinterpret_cast<const char*>(nb.data()), strnlen(reinterpret_cast<const char*>(nb.data()), nb.size()));
          if (off <= 0 || off > 4096) continue;
          uint32_t o = static_cast<uint32_t>(off);
          if (n == "co_firstlineno") in.layout.co_firstlineno = o;
          else if (n == "co_filename") in.layout.co_filename = o;
          else if (n == "co_name") in.layout.co_name = o;
          else if (n == "co_qualname") in.layout.co_qualname = o;
          else if (n == "co_linetable") in.layout.co_linetable = o;
        }
      }
    in.runtime = runtime->vaddr + bias;
    in.code_type = code_type->vaddr + bias;
    in.eval.emplace_back(eval->vaddr + bias, eval->vaddr + eval->size + bias);
    for (auto [lo, hi] : cold_parts(path, eval->vaddr, eval->vaddr + eval->size)) in.eval.emplace_back(lo + bias, hi + bias);
    d.interp = std::move(in);
    return d;
  }
  return d;
}

int line_at(const std::string& t, int first_line, int64_t addr) {
  if (addr < 0) return first_line;
  const auto* p = reinterpret_cast<const uint8_t*>(t.data());
  const uint8_t* end = p + t.size();
  auto varint = [&](const uint8_t*& q) {
    uint32_t v = 0;
    int shift = 0;
    while (q < end) {
      uint8_t b = *q++;
      v |= uint32_t(b & 63) << shift;
      shift += 6;
      if (!(b & 64) || shift > 30) break;
    }
    return v;
  };
  auto svarint = [&](const uint8_t*& q) {
    uint32_t u = varint(q);
    return (u & 1) ? -int(u >> 1) : int(u >> 1);
  };
  int line = first_line;
  int64_t at = 0;
  while (p < end) {
    uint8_t b = *p;
    if (!(b & 128)) {  // not an entry's first byte: skip (a corrupt table)
      p++;
      continue;
    }
    int code = (b >> 3) & 15;
    int64_t len = ((b & 7) + 1) * 2;  // code units of 2 bytes
    const uint8_t* q = p + 1;
    int delta = 0;
    if (code == 14 || code == 13) delta = svarint(q);
    else if (code >= 10 && code <= 12) delta = code - 10;
    line += delta;
    if (addr < at + len) return code == 15 ? -1 : line;
    at += len;
    p++;
    while (p < end && !(*p & 128)) p++;
  }
  return -1;
}

uint32_t FrameTable::intern(const PyFrame& f) {
  auto [it, fresh] = ids_.try_emplace(f, 0);
  if (!fresh) return it->second;
  frames_.push_back(f);
  it->second = static_cast<uint32_t>(frames_.size());
  if (on_new) on_new(it->second, f);
  return it->second;
}

bool FrameTable::put(uint32_t id, const PyFrame& f) {
  if (id == 0 || id > (1u << 24)) return false;
  if (frames_.size() < id) frames_.resize(id);
  if (!frames_[id - 1].function.empty() || !frames_[id - 1].file.empty()) return frames_[id - 1].function == f.function && frames_[id - 1].file == f.file && frames_[id - 1].line == f.line;
  frames_[id - 1] = f;
  ids_.emplace(f, id);
  return true;
}

std::optional<PyFrame> CodeTable::frame(uint64_t code, uint64_t prev_instr, uint32_t code_units) const {
  auto it = codes_.find(code);
  if (it == codes_.end()) return std::nullopt;
  const CodeInfo& k = it->second;
  int line = line_at(k.linetable, k.first_line, static_cast<int64_t>(prev_instr - (code + code_units)));
  return PyFrame{k.function, k.file, line < 0 ? 0 : line};
}

bool CodeReader::read(uint64_t addr, void* out, size_t len) const {
  iovec local{out, len}, remote{reinterpret_cast<void*>(addr), len};
  return process_vm_readv(pid_, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(len);
}

std::optional<std::string> CodeReader::read_str(uint64_t obj) const {
  const Layout& l = in_.layout;
  uint8_t h[48];
  if (!obj || !read(obj, h, sizeof h)) return std::nullopt;
  int64_t n;
  uint32_t state;
  memcpy(&n, h + l.str_length, 8);
  memcpy(&state, h + l.str_state, 4);
  unsigned kind = (state >> 2) & 7, compact = (state >> 5) & 1, ascii = (state >> 6) & 1;
  if (n < 0 || n > 4096 || !compact || !(kind == 1 || kind == 2 || kind == 4)) return std::nullopt;
  std::string raw(size_t(n) * kind, '\0');
  if (n && !read(obj + (ascii ? l.str_ascii_data : l.str_compact_data), raw.data(), raw.size())) return std::nullopt;
  if (kind == 1 && ascii) return raw;
  std::string out;
  for (int64_t i = 0; i < n; i++) {
    uint32_t c = 0;
    memcpy(&c, raw.data() + i * kind, kind);
    if (c < 0x80) out += char(c);
    else if (c < 0x800) out += char(0xc0 | c >> 6), out += char(0x80 | (c & 63));
    else if (c < 0x10000) out += char(0xe0 | c >> 12), out += char(0x80 | ((c >> 6) & 63)), out += char(0x80 | (c & 63));
    else
      out += char(0xf0 | c >> 18), out += char(0x80 | ((c >> 12) & 63)), out += char(0x80 | ((c >> 6) & 63)),
          out += char(0x80 | (c & 63));
  }
  return out;
}

std::optional<std::string> CodeReader::read_bytes(uint64_t obj) const {
  const Layout& l = in_.layout;
  int64_t n;
  if (!obj || !read(obj + l.bytes_size, &n, 8) || n < 0 || n > (1 << 20)) return std::nullopt;
  std::string s(n, '\0');
  if (n && !read(obj + l.bytes_data, s.data(), n)) return std::nullopt;
  return s;
}

// PyTypeObject (3.11): tp_basicsize at 32, tp_members at 240; PyMemberDef
// {char *name; int type; Py_ssize_t offset; int flags; char *doc} (40 bytes).
void CodeReader::init_layout() {
  if (layout_read_ || in_.layout.from_debug_offsets) return;
  int64_t basic = 0;
  if (!read(in_.code_type + 32, &basic, 8)) return;  // not readable yet: tried again
  layout_read_ = true;
  if (basic > 0 && basic < 4096) in_.layout.co_code_units = static_cast<uint32_t>(basic);
  uint64_t members = 0;
  if (!read(in_.code_type + 240, &members, 8) || !members) return;
  for (int i = 0; i < 64; i++) {
    uint8_t def[40];
    if (!read(members + i * 40, def, sizeof def)) return;
    uint64_t name_p;
    int64_t off;
    memcpy(&name_p, def, 8);
    memcpy(&off, def + 16, 8);
    if (!name_p) return;
    char name[32] = {};
    if (!read(name_p, name, sizeof name - 1)) {
      // a name near the end of a mapping: byte by byte
      for (size_t k = 0; k < sizeof name - 1 && read(name_p + k, name + k, 1) && name[k]; k++) {}
    }
    if (off <= 0 || off > 4096) continue;
    std::string n(name, strnlen(name, sizeof name));
    uint32_t o = static_cast<uint32_t>(off);
    if (n == "co_firstlineno") in_.layout.co_firstlineno = o;
    else if (n == "co_filename") in_.layout.co_filename = o;
    else if (n == "co_name") in_.layout.co_name = o;
    else if (n == "co_qualname") in_.layout.co_qualname = o;
    else if (n == "co_linetable") in_.layout.co_linetable = o;
  }
}

std::optional<PyFrame> CodeReader::frame(uint64_t code, uint64_t prev_instr, Counts& c) {
  init_layout();
  const Layout& l = in_.layout;
  uint32_t hi = std::max({l.co_firstlineno + 4, l.co_filename + 8, l.co_name + 8, l.co_qualname + 8, l.co_linetable + 8});
  std::vector<uint8_t> h(hi);
  if (!code || !read(code, h.data(), h.size())) {
    // The process gone (its last stacks drained after its exit): a code
    // object read before is named as it was then.
    if (auto it = codes_.find(code); code && it != codes_.end()) {
      c.named_after_exit++;
      int64_t addr = static_cast<int64_t>(prev_instr - (code + l.co_code_units));
      int line = line_at(it->second.linetable, it->second.first_line, addr);
      return PyFrame{it->second.function, it->second.file, line < 0 ? 0 : line};
    }
    c.code_unreadable++;
    return std::nullopt;
  }
  int32_t first;
  uint64_t fp[4];
  memcpy(&first, h.data() + l.co_firstlineno, 4);
  memcpy(&fp[1], h.data() + l.co_filename, 8);
  memcpy(&fp[2], h.data() + (l.co_qualname ? l.co_qualname : l.co_name), 8);
  memcpy(&fp[3], h.data() + l.co_linetable, 8);
  fp[0] = static_cast<uint32_t>(first);
  auto it = codes_.find(code);
  if (it == codes_.end() || memcmp(it->second.fingerprint, fp, sizeof fp) != 0) {
    if (it != codes_.end()) c.code_reused++;
    Code k;
    memcpy(k.fingerprint, fp, sizeof fp);
    auto fn = read_str(fp[2]);
    auto file = read_str(fp[1]);
    auto lt = read_bytes(fp[3]);
    if (!fn || !file || !lt) {
      c.code_unreadable++;
      return std::nullopt;
    }
    k.function = std::move(*fn);
    k.file = std::move(*file);
    k.linetable = std::move(*lt);
    k.first_line = first;
    it = codes_.insert_or_assign(code, std::move(k)).first;
  }
  const Code& k = it->second;
  int64_t addr = static_cast<int64_t>(prev_instr - (code + l.co_code_units));
  int line = line_at(k.linetable, k.first_line, addr);
  return PyFrame{k.function, k.file, line < 0 ? 0 : line};
}

std::vector<uint64_t> splice(const uint64_t* ips, uint32_t nr, const uint64_t* pairs, uint32_t py_nr, Mode mode,
                             const Interpreter& in, const std::function<uint64_t(uint64_t, uint64_t)>& name,
                             size_t max_frames, bool* cut, Counts& c) {
  // 3.13's shims (0, MT_PY_SHIM): dropped, the pair before each an entry frame's.
  std::vector<uint64_t> unshimmed;
  for (uint32_t k = 0; k < py_nr; k++)
    if (pairs[2 * k + 1] & MT_PY_SHIM) {
      if (unshimmed.empty()) continue;
      unshimmed.back() |= MT_PY_ENTRY;
    } else {
      unshimmed.push_back(pairs[2 * k]);
      unshimmed.push_back(pairs[2 * k + 1]);
    }
  if (unshimmed.size() != 2 * size_t{py_nr}) {
    pairs = unshimmed.data();
    py_nr = static_cast<uint32_t>(unshimmed.size() / 2);
  }
  std::vector<uint64_t> out;
  uint32_t j = 0;
  auto py = [&](uint32_t k) { return name(pairs[2 * k], pairs[2 * k + 1] & ~uint64_t(MT_PY_ENTRY)); };
  if (mode == Mode::Only && py_nr) {
    for (uint32_t k = 0; k < py_nr; k++) out.push_back(py(k));
  } else {
    for (uint32_t i = 0; i < nr; i++) {
      if (!py_nr || !in.in_eval(ips[i])) {
        if (mode != Mode::Only || !py_nr) out.push_back(ips[i]);
        continue;
      }
      // This evaluation's frames: up to and with the next entry frame.
      while (j < py_nr) {
        bool entry = pairs[2 * j + 1] & MT_PY_ENTRY;
        out.push_back(py(j++));
        if (entry) break;
      }
    }
    if (j < py_nr) c.unspliced += py_nr - j;
    while (j < py_nr) out.push_back(py(j++));
  }
  *cut = out.size() > max_frames;
  if (*cut) {
    out.resize(max_frames);
    c.frames_cut++;
  }
  return out;
}

}  // namespace memtrace::python
