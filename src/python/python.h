// src/python: CPython frames in allocation stacks (issue 32), user-space half.
//
//   detect(maps)          is there a CPython interpreter in this process (its
//                         executable or libpython among the mappings read by
//                         src/procfs), which version, where its _PyRuntime,
//                         PyCode_Type and _PyEval_EvalFrameDefault (with its
//                         .cold part, found by address: Debian's python3.11
//                         is stripped) are. Offsets: one small table per
//                         minor version (layout_for), corrected by the
//                         interpreter's own PyCode_Type (tp_basicsize, its
//                         member table) read from the process.
//   CodeReader            code objects read from a live process's memory
//                         (process_vm_readv), cached per code address and
//                         checked against reuse (a fingerprint re-read each
//                         time: first line, name, file and line-table pointers).
//   FrameTable            every distinct Python frame (function, file, line)
//                         under a small id; a stack carries it as
//                         heap::kPyFrameTag | id, the same in every process,
//                         kept in recordings (REC_PYFRAME).
//   splice(...)           memray's rule: each native frame inside
//                         _PyEval_EvalFrameDefault is replaced by the Python
//                         frames that evaluation ran, up to its entry frame.
//
// Nothing BPF in here; the record layout is bpf/memtrace.h's (struct
// mt_stack's pairs, struct mt_py_proc).
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/result.h"
#include "procfs/proc_maps.h"

namespace memtrace::python {

// One CPython minor version's layout (3.11: checked live against Debian 12's
// /usr/bin/python3.11, DESIGN.md "Field facts (turn 4)").
struct Layout {
  int major = 0, minor = 0;
  uint32_t runtime_tss = 0;  // _PyRuntime.autoTSSkey (its _is_initialized; _key 4 bytes on); 3.13: 0 if not found
  uint16_t tstate_cframe = 0, cframe_current = 0;
  uint16_t frame_code = 0, frame_previous = 0, frame_prev_instr = 0, frame_is_entry = 0;
  uint32_t co_firstlineno = 0, co_filename = 0, co_name = 0, co_qualname = 0, co_linetable = 0;
  uint32_t co_code_units = 0;  // PyCode_Type.tp_basicsize: the process's own value is used
  // str (PEP 393 compact objects) and bytes
  uint32_t str_length = 16, str_state = 32, str_ascii_data = 48, str_compact_data = 72;
  uint32_t bytes_size = 16, bytes_data = 32;
  // 3.12+: the thread's PyThreadState is the TLS variable _Py_tss_tstate, at
  // fsbase + tstate_tls (the interpreter's _PyThreadState_GetCurrent reads it
  // so); 0: through the TSS key (3.11).
  int32_t tstate_tls = 0;
  bool no_cframe = false;    // 3.13: tstate_cframe is PyThreadState.current_frame itself
  uint16_t frame_owner = 0;  // 3.12+: _PyInterpreterFrame.owner (no is_entry) ...
  uint8_t owner_cstack = 0;  // ... and its FRAME_OWNED_BY_CSTACK: the shim below an entry frame
  bool from_debug_offsets = false;  // read from _Py_DebugOffsets: PyCode_Type's tables change nothing
};
// 3.13+: the layout published at the start of _PyRuntime (_Py_DebugOffsets),
// its cookie and version checked; bytes: the file's (or the process's) copy,
// at least 584 of them. Error: not that structure, or not a version whose
// structure this reads (one line).
Result<Layout> layout_from_debug_offsets(const std::vector<uint8_t>& bytes, uint64_t runtime_size);
// 3.12+: the fs-relative offset of _Py_tss_tstate, from the code of
// _PyThreadState_GetCurrent (a local-exec TLS load in an executable:
// [endbr64] mov %fs:disp32,%rax; ret); nullopt: other code (a shared libpython).
std::optional<int32_t> tls_offset_from_code(const std::vector<uint8_t>& code);
// 3.13: _PyRuntime.autoTSSkey's offset in _PyRuntime, from the code of
// PyGILState_GetThisThreadState at vaddr: [endbr64] cmpl $0,disp32(%rip)
// (its _is_initialized) then mov disp32(%rip),%edi (its _key, 4 bytes on).
// The thread's state through that key is there while the thread has let
// the GIL go (_Py_tss_tstate is NULL then: a C extension's call, ctypes').
// nullopt: other code, or outside [runtime, runtime + runtime_size).
std::optional<uint32_t> tss_offset_from_code(const std::vector<uint8_t>& code, uint64_t vaddr, uint64_t runtime,
                                             uint64_t runtime_size);
const Layout* layout_for(int major, int minor);  // nullptr: not supported

enum class Mode { Off, On, Only };
Result<Mode> parse_mode(const std::string& s);  // "off", "on", "only"

// CPython in a process.
struct Interpreter {
  std::string path;  // the file that holds the interpreter (program or libpython)
  int major = 0, minor = 0, micro = 0;
  Layout layout;
  uint64_t runtime = 0;    // &_PyRuntime in the process
  uint64_t code_type = 0;  // &PyCode_Type
  // [start, end) in the process: _PyEval_EvalFrameDefault, then its .cold parts.
  std::vector<std::pair<uint64_t, uint64_t>> eval;
  bool in_eval(uint64_t return_address) const;
  std::string version() const;  // "3.11.2"
};
struct Detected {
  std::optional<Interpreter> interp;
  std::string unsupported;  // a CPython found whose version is not supported: one line naming it
};
// From a process's mappings as src/procfs read them (files opened by their
// paths; root: prefix for a container's, "" here).
Detected detect(const std::vector<procfs::Mapping>& maps, const std::string& root = "");
// The .cold parts of the function at [hot_lo, hot_hi) of an ELF file (vaddrs):
// code that no symbol covers, that CFI describes as functions of their own
// (FDE ranges), and that a direct jump of the function lands in.
std::vector<std::pair<uint64_t, uint64_t>> cold_parts(const std::string& path, uint64_t hot_lo, uint64_t hot_hi);

// Location table (PEP 657, 3.11's format): the line of the instruction at
// byte offset addr (< 0: the frame has not started: first_line); -1: none.
int line_at(const std::string& linetable, int first_line, int64_t addr);

struct PyFrame {
  std::string function;  // co_qualname (3.11+), else co_name
  std::string file;      // co_filename
  int line = 0;
  bool operator<(const PyFrame& o) const {
    return std::tie(function, file, line) < std::tie(o.function, o.file, o.line);
  }
};

// Every Python frame of a run, numbered from 1.
class FrameTable {
 public:
  uint32_t intern(const PyFrame& f);  // new frames are told to on_new
  const PyFrame* find(uint32_t id) const { return id && id <= frames_.size() ? &frames_[id - 1] : nullptr; }
  // Replay: a recorded frame under its recorded id (false: the id is taken by another frame).
  bool put(uint32_t id, const PyFrame& f);
  size_t size() const { return frames_.size(); }
  std::function<void(uint32_t, const PyFrame&)> on_new;

 private:
  std::vector<PyFrame> frames_;  // id - 1
  std::map<PyFrame, uint32_t> ids_;
};

// Counts of what the user-space half could not name (DROPPED / stats).
struct Counts {
  uint64_t code_unreadable = 0;  // a code object (or its strings) could not be read: frame named "?"
  uint64_t code_reused = 0;      // a cached code object's address held another one (re-read): informational
  uint64_t frames_cut = 0;       // spliced stacks cut at the record's frame limit
  uint64_t unspliced = 0;        // Python frames with no _PyEval_EvalFrameDefault frame to replace: appended outermost
  uint64_t named_after_exit = 0; // code objects named from the cache, their process's memory gone: informational
};

// Code objects of one process as BPF sent them (MT_EV_PYCODE), by address:
// a later record for an address (another code object there now, its
// fingerprint changed) replaces the earlier one for the stacks after it.
struct CodeInfo {
  std::string function, file, linetable;
  int first_line = 0;
  bool table_cut = false;  // lines past the table's cut are unknown (0)
};
class CodeTable {
 public:
  void add(uint64_t code, CodeInfo c) { codes_[code] = std::move(c); }
  bool has(uint64_t code) const { return codes_.count(code) != 0; }
  // code_units: where the instructions start in a code object (tp_basicsize).
  std::optional<PyFrame> frame(uint64_t code, uint64_t prev_instr, uint32_t code_units) const;
  size_t size() const { return codes_.size(); }

 private:
  std::unordered_map<uint64_t, CodeInfo> codes_;
};

// Code objects of one live process, read from its memory (process_vm_readv):
// what a code record could not carry (a name that is not ASCII), and tests.
class CodeReader {
 public:
  CodeReader(pid_t pid, const Interpreter& in) : pid_(pid), in_(in) {}
  // The frame executing code (an address in the process) at prev_instr.
  std::optional<PyFrame> frame(uint64_t code, uint64_t prev_instr, Counts& c);

 private:
  struct Code {
    uint64_t fingerprint[4] = {};  // firstlineno, filename, name (qualname), linetable pointers
    std::string function, file, linetable;
    int first_line = 0;
  };
  bool read(uint64_t addr, void* out, size_t len) const;
  std::optional<std::string> read_str(uint64_t obj) const;
  std::optional<std::string> read_bytes(uint64_t obj) const;
  void init_layout();  // PyCode_Type's tp_basicsize and member table, once
  pid_t pid_;
  Interpreter in_;
  bool layout_read_ = false;
  std::unordered_map<uint64_t, Code> codes_;
};

// A BPF stack record's frames, spliced: native ips[0..nr), pairs
// (code, prev_instr | MT_PY_ENTRY) innermost first, each named by name()
// (its tagged frame, heap::kPyFrameTag | id). At most max_frames out;
// *cut: more were there.
std::vector<uint64_t> splice(const uint64_t* ips, uint32_t nr, const uint64_t* pairs, uint32_t py_nr, Mode mode,
                             const Interpreter& in, const std::function<uint64_t(uint64_t, uint64_t)>& name,
                             size_t max_frames, bool* cut, Counts& c);

}  // namespace memtrace::python
