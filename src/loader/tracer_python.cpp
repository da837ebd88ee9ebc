// Tracer: Python frames (issue 32). A process whose mappings hold CPython
// (python::detect) gets a py_procs entry, the BPF walk's offsets and TSS key
// address; its stack records come with (code object, prev_instr) pairs,
// spliced here into the native frames before the heap model and a recording
// see them (src/python).
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include <algorithm>
#include <cstring>
#include <iostream>

#include "loader/tracer.h"
#include "memtrace_bpf.skel.h"

namespace memtrace::loader {

bool Tracer::python_add(pid_t pid, const std::vector<procfs::Mapping>* maps, mt_py_proc* walk) {
#if defined(__x86_64__)
  if (!maps) return false;
  if (o_.python_frames == python::Mode::Off || !o_.stacks) {  // the python domain alone (BPF path)
    if (walk || o_.inject || !skel_ || !o_.python_domain || pymem_.count(pid)) return false;
    python::Detected d = python::detect(*maps);
    if (d.interp) pymem_add(pid, *d.interp, *maps);
    return false;
  }
  // The BPF walk: not for a process the agent traces (it walks its own).
  if (!walk && (!skel_ || (o_.inject && procs_.count(pid) && procs_[pid].injected))) return false;
  if (auto it = py_.find(pid); it != py_.end() && it->second.exited) python_forget(pid);  // the pid used again
  if (auto it = py_.find(pid); it != py_.end()) {
    // The same interpreter still mapped: nothing new.
    for (const auto& m : *maps)
      if (m.exec() && m.path == it->second.in.path && m.start <= it->second.in.eval.front().first &&
          it->second.in.eval.front().first < m.end && !walk)
        return true;
    python_forget(pid);
  }
  python::Detected d = python::detect(*maps);
  if (!d.unsupported.empty()) {
    if (py_unsupported_.insert(d.unsupported).second) std::cerr << "memtrace-bpf: " << d.unsupported << "\n";
    return false;
  }
  if (!d.interp) return false;
  const python::Layout& l = d.interp->layout;
  mt_py_proc v{};
  v.tss_addr = d.interp->runtime + l.runtime_tss;
  v.tsd_off = 0x310;  // glibc 2.36 x86-64: offsetof(struct pthread, specific_1stblock)
  v.tstate_cframe = l.tstate_cframe;
  v.cframe_current = l.cframe_current;
  v.frame_window = l.frame_code;
  v.w_code = 0;
  v.w_previous = static_cast<uint8_t>(l.frame_previous - l.frame_code);
  v.w_prev_instr = static_cast<uint8_t>(l.frame_prev_instr - l.frame_code);
  if (l.frame_owner) {  // 3.13: the window from f_executable, the shims found by their owner
    uint16_t lo = std::min({l.frame_code, l.frame_previous, l.frame_prev_instr, l.frame_owner});
    uint16_t hi = std::max({l.frame_code + 8, l.frame_previous + 8, l.frame_prev_instr + 8, l.frame_owner + 1});
    if (hi - lo > MT_PY_WINDOW_OWNER) {
      if (py_unsupported_.insert(d.interp->path).second)
        std::cerr << "memtrace-bpf: CPython " << d.interp->version() << " (" << d.interp->path
                  << "): its frame's fields span " << hi - lo << " bytes, more than the walk reads; native stacks only\n";
      return false;
    }
    v.frame_window = lo;
    v.w_code = static_cast<uint8_t>(l.frame_code - lo);
    v.w_previous = static_cast<uint8_t>(l.frame_previous - lo);
    v.w_prev_instr = static_cast<uint8_t>(l.frame_prev_instr - lo);
    v.w_is_entry = static_cast<uint8_t>(l.frame_owner - lo);
    v.owner_cstack = l.owner_cstack;
    v.flags |= MT_PYP_OWNER;
  } else {
    v.w_is_entry = static_cast<uint8_t>(l.frame_is_entry - l.frame_code);
  }
  if (l.tstate_tls) {
    v.flags |= MT_PYP_TLS;
    v.tls_off = l.tstate_tls;
    // While the thread has let the GIL go its state is through the TSS key
    // (3.13's autoTSSkey), where the code that reads it says it is.
    v.tss_addr = l.runtime_tss ? d.interp->runtime + l.runtime_tss : 0;
  }
  if (l.no_cframe) v.flags |= MT_PYP_NO_CFRAME;
  v.co_firstlineno = static_cast<uint16_t>(l.co_firstlineno);
  v.co_filename = static_cast<uint16_t>(l.co_filename);
  v.co_qualname = static_cast<uint16_t>(l.co_qualname ? l.co_qualname : l.co_name);
  v.co_linetable = static_cast<uint16_t>(l.co_linetable);
  v.str_state = static_cast<uint16_t>(l.str_state);
  v.str_ascii_data = static_cast<uint16_t>(l.str_ascii_data);
  v.bytes_size = static_cast<uint16_t>(l.bytes_size);
  v.bytes_data = static_cast<uint16_t>(l.bytes_data);
  uint32_t key = static_cast<uint32_t>(pid);
  if (walk) {
    *walk = v;
  } else if (bpf_map_update_elem(bpf_map__fd(skel_->maps.py_procs), &key, &v, BPF_ANY) != 0) {
    errors_.push_back("python frames of pid " + std::to_string(pid) + ": py_procs map update: " + strerror(errno));
    return false;
  }
  log("pid " + std::to_string(pid) + ": CPython " + d.interp->version() + " in " + d.interp->path);
  py_seen_ = true;
  PyProc& p = py_[pid];
  p.in = *d.interp;
  p.code = std::make_unique<python::CodeReader>(pid, p.in);
  if (!walk && !o_.inject) pymem_add(pid, p.in, *maps);  // the BPF path's python domain (not beside an agent)
  return true;
#else
  (void)pid;
  (void)maps;
  (void)walk;
  return false;
#endif
}

void Tracer::python_forget(pid_t pid, bool exited) {
  pymem_forget(pid, exited);
  auto it = py_.find(pid);
  if (it == py_.end()) return;
  if (skel_) {
    uint32_t key = static_cast<uint32_t>(pid);
    bpf_map_delete_elem(bpf_map__fd(skel_->maps.py_procs), &key);
  }
  // Exited: its stacks still queued are named from what was read of it
  // (the next image of the pid, or another process given it, starts anew).
  if (exited) it->second.exited = true;
  else py_.erase(it);
}

bool Tracer::python_splice(const void* data, size_t len, std::vector<char>& out) {
  const auto* p = static_cast<const char*>(data);
  mt_hdr h;
  uint32_t nr, py_nr;
  memcpy(&h, p, sizeof h);
  memcpy(&nr, p + offsetof(mt_stack, nr), sizeof nr);
  memcpy(&py_nr, p + offsetof(mt_stack, py_nr), sizeof py_nr);
  if (py_nr == 0 || nr > MT_MAX_FRAMES || py_nr > MT_MAX_PY_FRAMES || len < MT_STACK_BYTES(size_t{nr} + 2 * py_nr))
    return false;
  std::vector<uint64_t> ips(nr), pairs(2 * size_t{py_nr});
  if (nr) memcpy(ips.data(), p + MT_STACK_HDR_BYTES, 8 * size_t{nr});
  memcpy(pairs.data(), p + MT_STACK_HDR_BYTES + 8 * size_t{nr}, pairs.size() * 8);
  std::vector<uint64_t> spliced = ips;
  bool cut = false;
  auto it = py_.find(static_cast<pid_t>(h.pid));
  if (it == py_.end()) {
    py_gone_ += py_nr;  // its interpreter forgotten (exec, exit) before the record came
  } else {
    PyProc& pp = it->second;
    spliced = python::splice(
        ips.data(), nr, pairs.data(), py_nr, o_.python_frames, pp.in,
        [&](uint64_t code, uint64_t instr) {
          auto f = pp.codes.frame(code, instr, pp.in.layout.co_code_units);
          if (!f) {
            py_code_fallback_++;
            f = pp.code->frame(code, instr, py_counts_);
          }
          return heap::kPyFrameTag |
                 py_frames_.intern(f ? *f : python::PyFrame{"?", "<code object unreadable>", 0});
        },
        MT_MAX_FRAMES, &cut, py_counts_);
  }
  out.assign(p, p + MT_STACK_HDR_BYTES);
  uint32_t n = static_cast<uint32_t>(spliced.size()), zero = 0;
  if (cut) h.flags |= MT_F_STACK_TRUNCATED;
  memcpy(out.data(), &h, sizeof h);
  memcpy(out.data() + offsetof(mt_stack, nr), &n, sizeof n);
  memcpy(out.data() + offsetof(mt_stack, py_nr), &zero, sizeof zero);
  out.resize(MT_STACK_BYTES(size_t{n}));
  if (n) memcpy(out.data() + MT_STACK_HDR_BYTES, spliced.data(), 8 * size_t{n});
  return true;
}

void Tracer::python_code(const void* data, size_t len) {
  if (len < sizeof(mt_py_code)) return;
  const auto& r = *static_cast<const mt_py_code*>(data);
  py_code_records_++;
  auto it = py_.find(static_cast<pid_t>(r.h.pid));
  if (it == py_.end() || (r.flags & (MT_PYC_NONASCII | MT_PYC_UNREADABLE))) return;  // named from its memory, if it lives
  python::CodeInfo c;
  c.function.assign(r.name, strnlen(r.name, sizeof r.name));
  c.file.assign(r.file, strnlen(r.file, sizeof r.file));
  c.linetable.assign(reinterpret_cast<const char*>(r.table), std::min<size_t>(r.table_len, sizeof r.table));
  c.first_line = r.first_line;
  c.table_cut = r.flags & MT_PYC_TABLE_CUT;
  it->second.codes.add(r.code, std::move(c));
}

void Tracer::python_drops(report::Drops& d) const {
  pymem_drops(d);
  if (o_.python_frames == python::Mode::Off || !py_seen_) return;
  d.dropped["python_code_unreadable"] = py_counts_.code_unreadable;
  d.dropped["python_frames_of_gone_process"] = py_gone_;
  d.stats["python_frames_unspliced"] = py_counts_.unspliced;
  d.stats["python_code_address_reused"] = py_counts_.code_reused;
  d.stats["python_stacks_cut"] = py_counts_.frames_cut;
  d.stats["python_code_named_after_exit"] = py_counts_.named_after_exit;
  d.stats["python_code_records"] = py_code_records_;
  d.stats["python_code_read_from_memory"] = py_code_fallback_;
  d.stats["python_frames_named"] = py_frames_.size();
}

}  // namespace memtrace::loader
