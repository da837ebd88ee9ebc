#include "common/hex.h"
#include "loader/features.h"
#include "loader/live_view.h"

#include <poll.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "loader/procfs.h"
#include "loader/recording.h"
#include "memtrace.h"

namespace memtrace::loader {
namespace {

const char* role_name(uint32_t r) {
  static const char* n[] = {"malloc",         "calloc",        "realloc",  "reallocarray", "free",
                            "posix_memalign", "aligned_alloc", "memalign", "valloc",       "pvalloc",
                            "aligned_new",    "PyObject_Malloc", "PyObject_Calloc", "PyObject_Realloc",
                            "PyObject_Free"};
  static_assert(sizeof(n) / sizeof(n[0]) == MT_ROLE_COUNT);
  return r < MT_ROLE_COUNT ? n[r] : "?";
}

// "function+0xoff (file:line) in module" from a frames_json element.
std::string frame_text(const nlohmann::json& f) {
  std::string s = f.value("address", "") + " ";
  std::string fn = f.value("function", "");
  std::string mod = f.value("module", "");
  s += fn.empty() ? "??" : fn;
  if (!fn.empty() && !f.value("inlined", false) && f.value("offset", 0ull)) s += "+" + hex(f["offset"]);
  // As the report prints it: "?? (git+0x6a3f2)", to be symbolized later.
  if (fn.empty() && !mod.empty() && f.contains("module_offset"))
    s += " (" + mod.substr(mod.rfind('/') + 1) + "+" + f["module_offset"].get<std::string>() + ")";
  if (f.contains("file")) s += " (" + f["file"].get<std::string>() + ":" + std::to_string(f.value("line", 0)) + ")";
  if (f.value("inlined", false)) s += " [inlined]";
  if (!mod.empty()) s += " in " + mod;
  if (f.contains("unknown")) s += " <" + f["unknown"].get<std::string>() + ">";
  return s;
}

struct LiveBlock {
  uint64_t addr;
  const heap::Block* b;
};
struct LiveGroup {
  uint64_t stack_id = 0, bytes = 0;
  std::vector<LiveBlock> blocks;
};

// Groups by stack, largest first; oldest block first in a group.
std::vector<LiveGroup> live_groups(const heap::Process& p) {
  std::unordered_map<uint64_t, LiveGroup> g;
  for (const auto& [addr, b] : p.live) {
    auto& lg = g[b.stack_id];
    lg.stack_id = b.stack_id;
    lg.bytes += b.size;
    lg.blocks.push_back({addr, &b});
  }
  std::vector<LiveGroup> v;
  for (auto& [k, lg] : g) {
    std::sort(lg.blocks.begin(), lg.blocks.end(), [](const LiveBlock& a, const LiveBlock& b) {
      return a.b->ts != b.b->ts ? a.b->ts < b.b->ts : a.addr < b.addr;
    });
    v.push_back(std::move(lg));
  }
  std::sort(v.begin(), v.end(), [](const LiveGroup& a, const LiveGroup& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.stack_id < b.stack_id;
  });
  return v;
}

// The first n bytes of a block of a live process; "" and *err when unreadable.
struct Reader {
  pid_t pid;
  bool gone = false;
  bool read(uint64_t addr, size_t n, std::string* out, std::string* err) {
    if (gone) {
      *err = "process gone";
      return false;
    }
    out->assign(n, '\0');
    iovec local{out->data(), n}, remote{reinterpret_cast<void*>(addr), n};
    ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got < 0) {
      if (errno == ESRCH) {
        gone = true;
        *err = "process gone";
      } else {
        *err = std::string("unreadable: ") + strerror(errno);
      }
      return false;
    }
    out->resize(got);
    return true;
  }
};

std::string hex_bytes(const std::string& s) {
  std::string h;
  char b[4];
  for (unsigned char c : s) {
    snprintf(b, sizeof b, "%02x", c);
    h += b;
  }
  return h;
}

std::string ascii(const std::string& s) {
  std::string a;
  for (unsigned char c : s) a += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '.';
  return a;
}

void hexdump(std::ostream& os, const std::string& s, const char* indent) {
  for (size_t off = 0; off < s.size(); off += 16) {
    char b[32];
    snprintf(b, sizeof b, "%04zx ", off);
    os << indent << b;
    std::string chunk = s.substr(off, 16);
    for (size_t i = 0; i < 16; i++) {
      if (i == 8) os << ' ';
      if (i < chunk.size()) {
        snprintf(b, sizeof b, " %02x", static_cast<unsigned char>(chunk[i]));
        os << b;
      } else {
        os << "   ";
      }
    }
    os << "  |" << ascii(chunk) << "|\n";
  }
}

bool readable_now(const heap::Process& p) { return !p.exited && process_exists(p.pid); }

}  // namespace

uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
}

std::string check_feature_options(const FeatureOptions& f, bool launch_mode) {
  if (f.console && launch_mode)
    return "--console reads commands from stdin, which belongs to the launched program: use it with -p, -c "
           "or system-wide (start the program, then attach with -p PID --console)";
  if (f.live_view && launch_mode)
    return "the live view (top) reads its keys from stdin, which belongs to the launched program: use it with -p, "
           "-c, --cgroup or system-wide";
  if (f.live_view && f.console) return "the live view (top) and --console both read stdin: use one of them";
  if (f.live_max == 0) return "--live-max must be at least 1";
  if (f.dump_bytes > 4096) return "--dump-bytes is at most 4096";
  return "";
}

void write_live_text(std::ostream& os, const heap::HeapModel& m, const report::Resolver& r, const heap::Process& p,
                     const LiveOptions& o) {
  auto groups = live_groups(p);
  os << "LIVE BLOCKS for pid " << p.pid << " (" << p.comm << "): " << p.live.size() << " blocks, "
     << p.s.in_use_bytes << " bytes, " << groups.size() << " stacks\n";
  Reader rd{p.pid, !o.readable || !readable_now(p)};
  size_t shown = 0;
  for (const auto& g : groups) {
    if (shown >= o.max) break;
    os << "  " << g.bytes << " bytes in " << g.blocks.size() << " blocks from stack " << hex(g.stack_id) << "\n";
    bool trunc = false;
    auto frames = report::frames_json(m, r, p, g.stack_id, &trunc);
    if (frames.empty()) os << "      (no stack)\n";
    for (const auto& f : frames) os << "      " << frame_text(f) << "\n";
    if (trunc) os << "      ... (stack truncated)\n";
    for (const auto& lb : g.blocks) {
      if (shown >= o.max) break;
      shown++;
      double age = o.now_ns > lb.b->ts ? (o.now_ns - lb.b->ts) / 1e9 : 0;
      char b[128];
      snprintf(b, sizeof b, "    %s  %" PRIu64 " bytes  age %.3fs\n", hex(lb.addr).c_str(), lb.b->size, age);
      os << b;
      if (o.dump_bytes) {
        std::string bytes, err;
        if (!o.readable) err = "contents not recorded";
        if (err.empty() && rd.read(lb.addr, std::min<uint64_t>(o.dump_bytes, lb.b->size), &bytes, &err))
          hexdump(os, bytes, "      ");
        else
          os << "      (" << err << ")\n";
      }
    }
  }
  if (shown < p.live.size())
    os << "  ... " << (p.live.size() - shown) << " more live blocks omitted (--live-max " << o.max << ")\n";
  os << "\n";
}

void add_live_json(nlohmann::json& jp, const heap::HeapModel& m, const report::Resolver& r, const heap::Process& p,
                   const LiveOptions& o) {
  nlohmann::json arr = nlohmann::json::array();
  Reader rd{p.pid, !o.readable || !readable_now(p)};
  size_t shown = 0;
  for (const auto& g : live_groups(p)) {
    if (shown >= o.max) break;
    bool trunc = false;
    auto frames = report::frames_json(m, r, p, g.stack_id, &trunc);
    for (const auto& lb : g.blocks) {
      if (shown >= o.max) break;
      shown++;
      nlohmann::json jb = {{"address", hex(lb.addr)},
                           {"size", lb.b->size},
                           {"age_ms", o.now_ns > lb.b->ts ? (o.now_ns - lb.b->ts) / 1e6 : 0.0},
                           {"stack_id", hex(g.stack_id)},
                           {"stack", frames}};
      if (trunc) jb["stack_truncated"] = true;
      if (o.dump_bytes) {
        std::string bytes, err;
        if (!o.readable) err = "contents not recorded";
        if (err.empty() && rd.read(lb.addr, std::min<uint64_t>(o.dump_bytes, lb.b->size), &bytes, &err)) {
          jb["bytes"] = hex_bytes(bytes);
          jb["ascii"] = ascii(bytes);
        } else {
          jb["bytes_error"] = err;
        }
      }
      arr.push_back(std::move(jb));
    }
  }
  jp["live"] = std::move(arr);
  jp["live_total"] = p.live.size();
  jp["live_omitted"] = p.live.size() - shown;
}

// ------------------------------------------------------------------ Features

Features::Features(const FeatureOptions& o, FeatureContext ctx) : o_(o), c_(std::move(ctx)) {
  timespec rt, mono;
  clock_gettime(CLOCK_REALTIME, &rt);
  clock_gettime(CLOCK_MONOTONIC, &mono);
  realtime_offset_ns_ = (int64_t(rt.tv_sec) - mono.tv_sec) * 1000000000ll + (rt.tv_nsec - mono.tv_nsec);
  tty_ = isatty(0);
}

Features::~Features() {
  if (rec_) rec_->close();
}

std::unique_ptr<Features> Features::create(const FeatureOptions& o, FeatureContext ctx, std::string* err) {
  std::unique_ptr<Features> f(new Features(o, std::move(ctx)));
  if (!o.record.empty()) {
    nlohmann::json meta = {{"tool", "memtrace-bpf"},
                           {"system_wide", f->c_.system_wide},
                           {"include_idle", f->c_.include_idle},
                           {"command", f->c_.command},
                           {"max_images", f->c_.max_images},
                           {"start_time", time(nullptr)},
                           {"start_mono_ns", monotonic_ns()}};
    auto r = Recorder::open(o.record, meta);
    if (!r) {
      *err = r.error().message;
      return nullptr;
    }
    f->rec_ = std::move(*r);
  }
  if (o.trace && !f->c_.json)
    f->c_.out() << "TRACE time comm pid tid event address size old_address caller\n";
  if (o.console) {
    std::cout << "memtrace-bpf console: type help for the commands\n";
    f->prompt();
  }
  return f;
}

LiveOptions Features::live_options() const {
  LiveOptions lo;
  lo.max = o_.live_max;
  lo.dump_bytes = o_.dump_bytes;
  lo.now_ns = monotonic_ns();
  return lo;
}

void Features::snapshot_maps(pid_t pid, const std::vector<procfs::Mapping>* maps) {
  if (rec_) rec_->capture_maps(pid, maps);
}

void Features::on_event(const void* data, size_t len, const std::vector<procfs::Mapping>* maps) {
  if (len < sizeof(mt_hdr)) {
    if (rec_) rec_->write(REC_EVENT, data, len);
    return;
  }
  mt_hdr h;
  memcpy(&h, data, sizeof h);
  mt_event e{};
  bool is_event = h.kind != MT_EV_STACK && len >= sizeof(mt_event);
  if (is_event) memcpy(&e, data, sizeof e);
  if (rec_) {
    bool exec_map = is_event && e.h.kind == MT_EV_MMAP && ((e.old_size >> 32) & 0x4) &&
                    static_cast<int32_t>(e.aux) >= 0;
    if (h.kind != MT_EV_STACK && (seen_pids_.insert(h.pid).second || exec_map)) snapshot_maps(h.pid, maps);
    rec_->write(REC_EVENT, data, len);
  }
  if (o_.trace && is_event && h.kind != MT_EV_FAULT) trace_line(e);
}

void Features::python_frame(uint32_t id, const std::string& function, const std::string& file, int line) {
  if (rec_) rec_->write_json(REC_PYFRAME, {{"id", id}, {"function", function}, {"file", file}, {"line", line}});
}

void Features::on_proc_event(const void* data, size_t len, const MapsOf& maps) {
  if (!rec_ || len < sizeof(mt_proc_event)) return;  // (MT_EV_MAPFILE never comes here)
  rec_->write(REC_PROC, data, len);
  mt_proc_event e;
  memcpy(&e, data, sizeof e);
  if (e.h.kind == MT_EV_EXEC || e.h.kind == MT_EV_LIBMAP || e.h.kind == MT_EV_FORK) snapshot_maps(e.h.pid, maps());
}

void Features::trace_line(const mt_event& e) {
  heap::HeapModel& m = *c_.model;
  heap::Process& p = m.process(e.h.pid);
  if (p.comm.empty())
    if (auto c = read_comm(e.h.pid)) p.comm = *c;
  std::string ev;
  bool old = false, old_size = false;
  switch (e.h.kind) {
    case MT_EV_ALLOC: ev = role_name(e.role); old = e.old_addr != 0; break;
    case MT_EV_FREE: ev = e.role == MT_ROLE_FREE ? "free" : std::string("free(") + role_name(e.role) + ")"; break;
    case MT_EV_ALLOC_FAIL: ev = std::string(role_name(e.role)) + "-failed"; break;
    case MT_EV_REALLOC_FAIL: ev = "realloc-failed"; old = true; break;
    case MT_EV_MMAP: ev = "mmap"; break;
    case MT_EV_MUNMAP: ev = "munmap"; break;
    case MT_EV_MREMAP: ev = "mremap"; old = old_size = true; break;
    case MT_EV_BRK: ev = "brk"; old = true; break;  // address: the new break; old: what was asked
    default: return;
  }
  bool internal = e.h.flags & MT_F_ALLOCATOR_INTERNAL;
  nlohmann::json caller;
  if (const heap::Stack* st = e.stack_id ? m.stack(e.stack_id) : nullptr; st && !st->ips.empty()) {
    auto fs = c_.resolve(p, st->ips[0], nullptr, true);
    if (!fs.empty()) {
      const auto& f = fs[0];
      caller = {{"address", hex(f.address)}, {"function", f.function}, {"offset", f.offset}, {"module", f.module}};
      if (!f.file.empty()) {
        caller["file"] = f.file;
        caller["line"] = f.line;
      }
      if (f.inlined) caller["inlined"] = true;
      if (!f.unknown.empty()) caller["unknown"] = f.unknown;
      if (f.function.empty() && !f.module.empty()) caller["module_offset"] = hex(f.module_offset);
    }
  }
  int64_t wall = int64_t(e.h.ts) + realtime_offset_ns_;
  time_t secs = wall / 1000000000;
  struct tm tmv;
  localtime_r(&secs, &tmv);
  char tbuf[48];
  size_t n = strftime(tbuf, sizeof tbuf, "%H:%M:%S", &tmv);
  snprintf(tbuf + n, sizeof tbuf - n, ".%06lld", static_cast<long long>((wall % 1000000000) / 1000));
  std::ostream& os = c_.out();
  if (c_.json) {
    nlohmann::json j = {{"time", tbuf}, {"ts_ns", e.h.ts}, {"comm", p.comm},  {"pid", e.h.pid},
                        {"tid", e.h.tid}, {"event", ev},    {"address", hex(e.addr)}, {"size", e.size}};
    if (e.h.kind == MT_EV_BRK) {
      j.erase("size");
      j["requested"] = hex(e.size);
    } else if (old) {
      j["old_address"] = hex(e.old_addr);
    }
    if (old_size) j["old_size"] = e.old_size;
    if (internal) j["allocator_internal"] = true;
    if (e.stack_id) j["stack_id"] = hex(e.stack_id);
    j["caller"] = caller;
    os << "{\"trace\":" << report::json_text(j) << "}\n";
  } else {
    os << tbuf << ' ' << (p.comm.empty() ? "?" : p.comm) << ' ' << e.h.pid << ' ' << e.h.tid << ' ' << ev
       << (internal ? "[allocator]" : "") << ' ' << hex(e.addr) << ' ';
    if (e.h.kind == MT_EV_BRK)
      os << "- " << hex(e.size);  // brk(requested): no size; the old column holds the request
    else
      os << e.size << ' ' << (old ? hex(e.old_addr) : "-");
    if (old_size) os << '/' << e.old_size;
    os << ' ' << (caller.is_null() ? std::string("-") : frame_text(caller)) << '\n';
  }
  trace_lines_++;
  if (!os) {
    trace_write_errors_++;
    os.clear();
  }
}

// ------------------------------------------------------------------ console

void Features::prompt() {
  if (tty_) {
    std::cout << "> ";
    std::cout.flush();
  }
}

bool Features::tick() {
  bool quit = false;
  // The view starts with the run loop: a message of the set-up before it
  // stays on the normal screen.
  if (o_.live_view && !view_done_) {
    if (!view_) {
      LiveView::Context vc;
      vc.model = c_.model;
      vc.resolve = c_.resolve;
      vc.drain = c_.drain;
      vc.screen = &std::cout;
      vc.keys_fd = 0;
      view_ = std::make_unique<LiveView>(std::move(vc));
    }
    if (view_->tick()) return true;
  }
  if (o_.console && stdin_open_) {
    for (;;) {
      pollfd pfd{0, POLLIN, 0};
      if (::poll(&pfd, 1, 0) <= 0 || !(pfd.revents & (POLLIN | POLLHUP | POLLERR))) break;
      char b[4096];
      ssize_t n = ::read(0, b, sizeof b);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        stdin_open_ = false;
        if (!inbuf_.empty()) {
          command(inbuf_);
          inbuf_.clear();
        }
        std::cerr << "memtrace-bpf: end of console input: detaching\n";
        return true;
      }
      inbuf_.append(b, n);
      size_t nl;
      while ((nl = inbuf_.find('\n')) != std::string::npos) {
        std::string line = inbuf_.substr(0, nl);
        inbuf_.erase(0, nl + 1);
        std::istringstream ss(line);
        std::string w;
        ss >> w;
        if (w == "quit" || w == "exit" || w == "q") {
          std::cout << "Detaching\n";
          std::cout.flush();
          return true;
        }
        command(line);
        prompt();
      }
    }
  }
  if (monitor_s_ > 0 && monotonic_ns() >= next_monitor_ns_) {
    next_monitor_ns_ += static_cast<uint64_t>(monitor_s_ * 1e9);
    status(std::cout);
    std::cout.flush();
  }
  return quit;
}

void Features::status(std::ostream& os) {
  c_.drain();
  if (c_.json) {
    report::Options ro;
    ro.leaks = false;
    ro.at_exit = false;
    ro.include_idle = c_.include_idle;
    auto j = report::to_json(*c_.model, c_.resolve, ro, c_.drops());
    os << "{\"status\":" << report::json_text(j) << "}\n";
    return;
  }
  size_t n = 0;
  for (const auto& [pid, p] : c_.model->processes()) {
    bool active = p->s.allocs || p->s.frees || p->s.in_use_blocks || p->s.failed_allocs || p->s.mmap_calls;
    if (!active && !(c_.include_idle && !p->exited)) continue;
    report::write_summary_text(os, *p, false);
    n++;
  }
  if (!n) os << "no traced process has allocated anything yet\n";
}

void Features::full_report(std::ostream& os) {
  c_.drain();
  report::Options ro;
  ro.top = c_.top;
  ro.at_exit = false;
  ro.include_idle = c_.include_idle;
  auto d = c_.drops();
  if (c_.json) {
    auto j = report::to_json(*c_.model, c_.resolve, ro, d);
    add_json(j);
    os << "{\"report\":" << report::json_text(j) << "}\n";
  } else {
    report::write_text(os, *c_.model, c_.resolve, ro, d);
    write_text(os);
  }
}

void Features::live(std::ostream& os) {
  c_.drain();
  auto lo = live_options();
  if (c_.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& [pid, p] : c_.model->processes()) {
      if (p->live.empty()) continue;
      nlohmann::json jp = {{"pid", pid}, {"comm", p->comm}};
      add_live_json(jp, *c_.model, c_.resolve, *p, lo);
      arr.push_back(std::move(jp));
    }
    os << "{\"live\":" << report::json_text(arr) << "}\n";
    return;
  }
  size_t n = 0;
  for (const auto& [pid, p] : c_.model->processes()) {
    if (p->live.empty()) continue;
    write_live_text(os, *c_.model, c_.resolve, *p, lo);
    n++;
  }
  if (!n) os << "no live blocks\n";
}

// Console `diff`: the model now against the last `snapshot`.
void Features::diff(std::ostream& os) {
  if (!snapshot_) {
    os << (c_.json ? "{\"error\":\"no snapshot: type snapshot first\"}\n" : "no snapshot: type snapshot first\n");
    return;
  }
  c_.drain();
  report::Diff d = report::diff_since(*snapshot_, *c_.model, c_.resolve, c_.top);
  if (c_.json) os << report::json_text(report::diff_json(d)) << "\n";
  else report::write_diff_text(os, d);
}

void Features::command(const std::string& line) {
  std::istringstream ss(line);
  std::string w;
  if (!(ss >> w)) return;
  std::ostream& os = std::cout;
  if (w == "help" || w == "?") {
    os << "List of commands:\n"
          "       help: Display this help\n"
          "       quit: Detach and print the final report\n"
          "     status: Show the heap summary of each traced process\n"
          "  monitor N: Show the status every N seconds (monitor 0 stops)\n"
          "     report: Show the full report (leaks by stack)\n"
          "       live: List every live block (address, size, age, stack)\n"
          "      clear: Forget counters and live blocks\n"
          "   snapshot: Remember the counters by stack now, for diff\n"
          "       diff: What grew and shrank since the snapshot, by stack\n";
  } else if (w == "status") {
    status(os);
  } else if (w == "report") {
    full_report(os);
  } else if (w == "live") {
    live(os);
  } else if (w == "clear") {
    c_.drain();
    std::vector<pid_t> pids;
    for (const auto& [pid, p] : c_.model->processes()) pids.push_back(pid);
    for (pid_t pid : pids) c_.model->clear(pid);
    os << "Clearing list of allocations\n";
  } else if (w == "snapshot") {
    c_.drain();
    snapshot_ = std::make_unique<report::HeapSnapshot>(report::snapshot_heap(*c_.model));
    os << (c_.json ? "{\"snapshot\":true}\n" : "Snapshot taken: diff shows what changed since\n");
  } else if (w == "diff") {
    diff(os);
  } else if (w == "monitor") {
    double s = -1;
    if (!(ss >> s) || s < 0) {
      os << "usage: monitor SECONDS (monitor 0 stops)\n";
    } else if (s == 0) {
      monitor_s_ = 0;
      os << "Stop monitoring\n";
    } else {
      monitor_s_ = s;
      next_monitor_ns_ = monotonic_ns() + static_cast<uint64_t>(s * 1e9);
      os << "Start monitoring every " << s << " s\n";
      status(os);
    }
  } else {
    os << "unknown command '" << w << "'; type help for the list\n";
  }
  os.flush();
}

// ------------------------------------------------------------ final report

void Features::end_view() {
  view_.reset();
  view_done_ = true;
}

void Features::finish(const report::Drops& d, const std::vector<std::string>& errors) {
  end_view();
  if (finished_) return;
  finished_ = true;
  if (!rec_) return;
  nlohmann::json procs = nlohmann::json::array();
  for (const auto& [pid, p] : c_.model->processes()) {
    nlohmann::json jp = {{"pid", pid}, {"ppid", p->ppid}, {"comm", p->comm}, {"exited", p->exited}};
    if (!p->cgroup.empty()) jp["cgroup"] = p->cgroup;
    jp["exit_status"] = p->exit_code ? nlohmann::json(*p->exit_code) : nlohmann::json(nullptr);
    procs.push_back(std::move(jp));
  }
  // JIT code names, in pieces that fit a record (cut after a newline).
  if (c_.perf_maps)
    for (const auto& [pid, text] : c_.perf_maps()) {
      const size_t kPiece = 4u << 20;
      for (size_t at = 0; at < text.size();) {
        size_t n = std::min(kPiece, text.size() - at);
        if (at + n < text.size())
          if (size_t nl = text.rfind('\n', at + n - 1); nl != std::string::npos && nl >= at) n = nl + 1 - at;
        rec_->write_json(REC_PERFMAP, {{"pid", pid}, {"text", text.substr(at, n)}});
        at += n;
      }
    }
  nlohmann::json end = {{"processes", procs},  {"dropped", d.dropped}, {"stats", d.stats},
                        {"errors", errors},    {"mono_ns", monotonic_ns()}};
  rec_->write_json(REC_END, end);
  rec_->close();
  if (!rec_->error().empty()) std::cerr << "memtrace-bpf: " << rec_->error() << "\n";
}

void Features::add_json(nlohmann::json& j) {
  if (o_.live || o_.dump_bytes) {
    auto lo = live_options();
    std::map<std::pair<pid_t, uint32_t>, const heap::Process*> image;  // the JSON has one entry per image
    for (const heap::Process* p : c_.model->images())
      if (!p->merged) image[{p->pid, p->image}] = p;
    for (auto& jp : j["processes"]) {
      auto it = image.find({jp["pid"].get<pid_t>(), jp.value("exec_index", 0u)});
      if (it != image.end()) add_live_json(jp, *c_.model, c_.resolve, *it->second, lo);
    }
  }
  if (o_.trace) j["trace"] = {{"lines", trace_lines_}, {"write_errors", trace_write_errors_}};
  if (rec_) {
    j["recording"] = {{"file", o_.record}, {"records", rec_->records()}};
    if (!rec_->error().empty()) j["recording"]["error"] = rec_->error();
  }
}

void Features::write_text(std::ostream& os) {
  if (o_.live || o_.dump_bytes) {
    auto lo = live_options();
    for (const heap::Process* p : c_.model->images())
      if (!p->live.empty()) write_live_text(os, *c_.model, c_.resolve, *p, lo);
  }
  if (o_.trace) os << "TRACE: " << trace_lines_ << " lines, " << trace_write_errors_ << " write errors\n";
  if (rec_) {
    os << "RECORDING: " << o_.record << ", " << rec_->records() << " records";
    if (!rec_->error().empty()) os << ", error: " << rec_->error();
    os << "\n";
  }
}

}  // namespace memtrace::loader
