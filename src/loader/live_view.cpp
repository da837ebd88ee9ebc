#include "loader/live_view.h"

#include <poll.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <ctime>
#include <sstream>

namespace memtrace::loader {
namespace {

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
}

// 1536 -> "1.5 KiB": four significant places at most, as top shows sizes.
std::string human(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double a = b < 0 ? -b : b;
  while (a >= 1024 && u < 4) {
    a /= 1024;
    b /= 1024;
    u++;
  }
  char s[32];
  if (u == 0) snprintf(s, sizeof s, "%.0f B", b);
  else snprintf(s, sizeof s, "%.1f %s", b, units[u]);
  return s;
}

std::string signed_human(double b) { return (b > 0 ? "+" : "") + human(b); }

std::string pad(std::string s, size_t w, bool right) {
  if (s.size() >= w) return s;
  return right ? std::string(w - s.size(), ' ') + s : s + std::string(w - s.size(), ' ');
}

// The domain's part of a process's figures: python is its own summary, malloc
// the totals less it (heap_model.h: DomainSummary).
struct Figures {
  uint64_t in_use = 0, blocks = 0, allocs = 0, bytes = 0;
};
Figures figures(const heap::Process& p, LiveView::Domain d) {
  const heap::Summary& s = p.s;
  const heap::DomainSummary& py = s.python;
  if (d == LiveView::Domain::Python) return {py.in_use_bytes, py.in_use_blocks, py.allocs, py.bytes_allocated};
  return {s.in_use_bytes - py.in_use_bytes, s.in_use_blocks - py.in_use_blocks, s.allocs - py.allocs,
          s.bytes_allocated - py.bytes_allocated};
}

const char* domain_name(LiveView::Domain d) { return d == LiveView::Domain::Python ? "python" : "malloc"; }

}  // namespace

LiveView::LiveView(Context c) : c_(std::move(c)) {
  if (isatty(c_.keys_fd) && tcgetattr(c_.keys_fd, &saved_) == 0) {
    termios t = saved_;
    t.c_lflag &= ~(ICANON | ECHO);
    t.c_cc[VMIN] = 0;
    t.c_cc[VTIME] = 0;
    raw_ = tcsetattr(c_.keys_fd, TCSANOW, &t) == 0;
  }
  *c_.screen << "\x1b[?1049h\x1b[?25l" << std::flush;  // the alternate screen, no cursor
}

LiveView::~LiveView() {
  *c_.screen << "\x1b[?25h\x1b[?1049l" << std::flush;
  if (raw_) tcsetattr(c_.keys_fd, TCSANOW, &saved_);
}

std::vector<LiveView::Row> LiveView::rows(const heap::HeapModel& m, Domain d, Sort s,
                                          const std::map<pid_t, std::pair<uint64_t, uint64_t>>& before, double dt) {
  std::vector<Row> out;
  for (const auto& [pid, p] : m.processes()) {
    if (p->exited || p->prelude) continue;
    Figures f = figures(*p, d);
    if (!f.allocs && !f.blocks) continue;
    Row r{pid, p->comm, f.in_use, f.blocks, f.allocs, 0, 0};
    if (auto it = before.find(pid); it != before.end() && dt > 0) {
      r.growth = (double(f.in_use) - double(it->second.first)) / dt;
      r.alloc_rate = (double(f.bytes) - double(it->second.second)) / dt;
    }
    out.push_back(std::move(r));
  }
  auto key = [s](const Row& r) {
    return s == Sort::Growth ? r.growth : s == Sort::AllocRate ? r.alloc_rate : double(r.in_use);
  };
  std::stable_sort(out.begin(), out.end(), [&](const Row& a, const Row& b) {
    return key(a) != key(b) ? key(a) > key(b) : a.pid < b.pid;
  });
  return out;
}

bool LiveView::tick() {
  bool redraw = false;
  char b[64];
  for (;;) {
    // Only what is there: stdin may be a pipe, where a read would wait.
    pollfd pf{c_.keys_fd, POLLIN, 0};
    if (poll(&pf, 1, 0) <= 0 || !(pf.revents & POLLIN)) break;
    ssize_t n = read(c_.keys_fd, b, sizeof b);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // end of input
    for (ssize_t i = 0; i < n; i++) key(b[i]);
    redraw = true;
  }
  if (!esc_.empty() && !redraw) {  // a lone Esc: back
    esc_.clear();
    picked_ = 0;
    redraw = true;
  }
  if (quit_) return true;
  uint64_t now = now_ns();
  if (now >= next_draw_ns_) {  // a new sample
    if (c_.drain) c_.drain();
    prev_ = std::move(cur_);
    cur_.clear();
    for (const auto& [pid, p] : c_.model->processes()) {
      Figures f = figures(*p, domain_);
      cur_[pid] = {f.in_use, f.bytes};
    }
    prev_stack_bytes_ = std::move(cur_stack_bytes_);
    cur_stack_bytes_.clear();
    if (picked_)
      if (auto it = c_.model->processes().find(picked_); it != c_.model->processes().end()) {
        for (const auto& [id, st] : it->second->stack_allocs) cur_stack_bytes_[{picked_, id}] = st.bytes;
        stack_samples_++;
      }
    dt_ = last_ns_ ? double(now - last_ns_) / 1e9 : 0;
    last_ns_ = now;
    next_draw_ns_ = now + uint64_t(c_.refresh_s * 1e9);
    redraw = true;
  }
  if (redraw) draw();
  return false;
}

void LiveView::key(char k) {
  if (!esc_.empty()) {  // ESC [ A / ESC [ B: the arrows
    esc_ += k;
    if (esc_.size() < 3) return;
    if (esc_ == "\x1b[A" && cursor_ > 0) cursor_--;
    if (esc_ == "\x1b[B") cursor_++;
    esc_.clear();
    return;
  }
  switch (k) {
    case 'q': quit_ = true; break;
    case 'u': sort_ = Sort::InUse; break;
    case 'g': sort_ = Sort::Growth; break;
    case 'a': sort_ = Sort::AllocRate; break;
    case 'd':
      domain_ = domain_ == Domain::Malloc ? Domain::Python : Domain::Malloc;
      next_draw_ns_ = 0;  // the figures of the other domain: a new sample
      last_ns_ = 0;
      cur_.clear();
      break;
    case 'j': cursor_++; break;
    case 'k':
      if (cursor_ > 0) cursor_--;
      break;
    case '\n':
    case '\r':
      if (!picked_ && cursor_ < shown_.size()) {
        picked_ = shown_[cursor_];
        next_draw_ns_ = 0;  // its stacks' rates from the next sample on
        cur_stack_bytes_.clear();
        stack_samples_ = 0;
      }
      break;
    case 'b':
    case 127:
    case 8: picked_ = 0; break;
    case 0x1b: esc_ = "\x1b"; break;
    default: break;
  }
}

void LiveView::draw() {
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col && ws.ws_row) {
    cols_ = ws.ws_col;
    lines_ = ws.ws_row;
  }
  std::ostringstream o;
  if (picked_ && !c_.model->processes().count(picked_)) picked_ = 0;  // (never: the model keeps the pid's image)
  if (picked_) draw_process(o, lines_);
  else draw_processes(o, lines_);
  // Each line cut at the width, then cleared to its end; the rest cleared.
  std::string frame = "\x1b[H";
  std::istringstream in(o.str());
  size_t n = 0;
  for (std::string l; std::getline(in, l) && n < lines_; n++) {
    if (l.size() > cols_) l.resize(cols_);
    frame += l + "\x1b[K" + (n + 1 < lines_ ? "\r\n" : "");
  }
  frame += "\x1b[J";
  *c_.screen << frame << std::flush;
}

void LiveView::draw_processes(std::ostream& o, size_t height) {
  auto rs = rows(*c_.model, domain_, sort_, prev_, dt_);
  const char* by = sort_ == Sort::Growth ? "growth" : sort_ == Sort::AllocRate ? "allocation rate" : "in use";
  o << "memtrace-bpf top: " << rs.size() << " processes, " << domain_name(domain_) << " domain, by " << by
    << ", every " << c_.refresh_s << " s\n";
  o << "keys: u/g/a sort by in use/growth/alloc rate  d domain  j/k move  Enter stacks  q quit\n\n";
  o << "     " << pad("PID", 7, true) << "  " << pad("COMMAND", 16, false) << pad("IN USE", 12, true)
    << pad("BLOCKS", 10, true) << pad("GROWTH/s", 13, true) << pad("ALLOC/s", 12, true) << pad("ALLOCS", 12, true)
    << "\n";
  if (cursor_ >= rs.size()) cursor_ = rs.empty() ? 0 : rs.size() - 1;
  shown_.clear();
  size_t room = height > 5 ? height - 5 : 1;
  size_t first = cursor_ >= room ? cursor_ - room + 1 : 0;
  for (size_t i = first; i < rs.size() && i < first + room; i++) {
    const Row& r = rs[i];
    o << (i == cursor_ ? "  >  " : "     ") << pad(std::to_string(r.pid), 7, true) << "  " << pad(r.comm, 16, false)
      << pad(human(double(r.in_use)), 12, true) << pad(std::to_string(r.blocks), 10, true)
      << pad(dt_ > 0 ? signed_human(r.growth) : "-", 13, true) << pad(dt_ > 0 ? human(r.alloc_rate) : "-", 12, true)
      << pad(std::to_string(r.allocs), 12, true) << "\n";
  }
  shown_.resize(rs.size());
  for (size_t i = 0; i < rs.size(); i++) shown_[i] = rs[i].pid;
  if (rs.empty()) o << "     (no process has allocated in the " << domain_name(domain_) << " domain yet)\n";
}

void LiveView::draw_process(std::ostream& o, size_t height) {
  const heap::Process& p = *c_.model->processes().at(picked_);
  Figures f = figures(p, domain_);
  o << "memtrace-bpf top: pid " << p.pid << " (" << p.comm << "), " << domain_name(domain_) << " domain: "
    << f.in_use << " bytes (" << human(double(f.in_use)) << ") in use in " << f.blocks << " blocks, " << f.allocs
    << " allocations\n";
  o << "keys: b back  d domain  q quit\n";
  bool py = domain_ == Domain::Python;
  std::vector<std::pair<uint64_t, const heap::StackAllocs*>> mine;
  for (const auto& [id, st] : p.stack_allocs)
    if (st.python == py) mine.push_back({id, &st});
  size_t room = height > 8 ? (height - 8) / 2 : 1;
  size_t line_frames = 6;
  auto section = [&](const char* title, auto value, auto label) {
    std::stable_sort(mine.begin(), mine.end(), [&](const auto& a, const auto& b) {
      double va = value(a), vb = value(b);
      return va != vb ? va > vb : a.first < b.first;
    });
    o << "\n" << title << "\n";
    size_t n = 0;
    for (const auto& s : mine) {
      if (n >= room || value(s) <= 0) break;
      o << "  " << pad(label(s), 22, true) << "  " << report::stack_line(*c_.model, c_.resolve, p, s.first, line_frames)
        << "\n";
      n++;
    }
    if (!n) o << "  (none)\n";
  };
  section(
      "BY IN USE", [](const auto& s) { return double(s.second->live_bytes); },
      [](const auto& s) { return human(double(s.second->live_bytes)) + " " + std::to_string(s.second->live_blocks) + " blk"; });
  auto rate = [&](const auto& s) {
    if (dt_ <= 0 || stack_samples_ < 2) return 0.0;
    auto now = cur_stack_bytes_.find({picked_, s.first});
    auto then = prev_stack_bytes_.find({picked_, s.first});
    if (now == cur_stack_bytes_.end()) return 0.0;
    double before = then == prev_stack_bytes_.end() ? 0 : double(then->second);
    return (double(now->second) - before) / dt_;
  };
  section("BY ALLOCATION RATE", rate, [&](const auto& s) { return human(rate(s)) + "/s"; });
}

}  // namespace memtrace::loader
