#include "symbolize/perf_map.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <iterator>

namespace memtrace::symbolize {

namespace {

// A hex number at the front of s (0x optional), then the spaces after it.
bool take_hex(std::string_view& s, uint64_t* v) {
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) s.remove_prefix(2);
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v, 16);
  if (ec != std::errc() || end == s.data()) return false;
  s.remove_prefix(end - s.data());
  if (s.empty() || (s[0] != ' ' && s[0] != '\t')) return false;
  while (!s.empty() && (s[0] == ' ' || s[0] == '\t')) s.remove_prefix(1);
  return true;
}

}  // namespace

void PerfMap::line(std::string_view l) {
  if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
  if (l.empty()) return;
  lines_++;
  PerfMapEntry e;
  if (!take_hex(l, &e.start) || !take_hex(l, &e.size) || l.empty() || e.size == 0 || e.start + e.size < e.start) {
    bad_++;
    return;
  }
  e.name.assign(l);
  uint64_t at = e.start;
  by_start_[at] = std::move(e);  // code made again at the same address: the newer name
}

void PerfMap::feed(std::string_view text) {
  while (!text.empty()) {
    size_t nl = text.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(text);
      return;
    }
    if (partial_.empty()) {
      line(text.substr(0, nl));
    } else {
      partial_.append(text.substr(0, nl));
      line(partial_);
      partial_.clear();
    }
    text.remove_prefix(nl + 1);
  }
}

void PerfMap::finish() {
  if (partial_.empty()) return;
  std::string l;
  l.swap(partial_);
  line(l);
}

const PerfMapEntry* PerfMap::find(uint64_t addr) const {
  auto it = by_start_.upper_bound(addr);
  // The nearest starts below addr; an older, longer entry may cover it past
  // a shorter one (a few steps back: code pieces are small).
  for (int steps = 0; it != by_start_.begin() && steps < 16; steps++) {
    --it;
    const PerfMapEntry& e = it->second;
    if (addr - e.start < e.size) return &e;
  }
  return nullptr;
}

void PerfMap::clear() {
  partial_.clear();
  by_start_.clear();
  bad_ = lines_ = 0;
}

bool PerfMapFile::refresh() {
  if (!fd_.valid()) {
    if (path_.empty()) return false;
    fd_.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd_.valid()) return false;
  }
  struct stat st {};
  if (fstat(fd_.get(), &st) != 0) return false;
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == read_) return false;
  if (size < read_) {  // a new file at the path: read from its start
    map_.clear();
    text_.clear();
    read_ = 0;
  }
  char buf[65536];
  bool changed = false;
  while (read_ < size) {
    ssize_t n = pread(fd_.get(), buf, sizeof buf, static_cast<off_t>(read_));
    if (n <= 0) break;
    map_.feed(std::string_view(buf, static_cast<size_t>(n)));
    text_.append(buf, static_cast<size_t>(n));
    read_ += static_cast<uint64_t>(n);
    changed = true;
  }
  return changed;
}

}  // namespace memtrace::symbolize
