#include "procfs/proc_maps.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <charconv>

#include "common/fd.h"

namespace memtrace::procfs {

int Mapping::prot() const {
  return (readable() ? PROT_READ : 0) | (writable() ? PROT_WRITE : 0) | (exec() ? PROT_EXEC : 0);
}

namespace {

bool take_hex(std::string_view& s, uint64_t& v) {
  auto r = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (r.ec != std::errc() || r.ptr == s.data()) return false;
  s.remove_prefix(static_cast<size_t>(r.ptr - s.data()));
  return true;
}
bool take_dec(std::string_view& s, uint64_t& v) {
  auto r = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (r.ec != std::errc() || r.ptr == s.data()) return false;
  s.remove_prefix(static_cast<size_t>(r.ptr - s.data()));
  return true;
}
bool take_char(std::string_view& s, char c) {
  if (s.empty() || s[0] != c) return false;
  s.remove_prefix(1);
  return true;
}
void skip_spaces(std::string_view& s) {
  while (!s.empty() && (s[0] == ' ' || s[0] == '\t')) s.remove_prefix(1);
}

}  // namespace

bool parse_maps_line(std::string_view s, Mapping& m) {
  uint64_t maj = 0, min = 0;
  if (!take_hex(s, m.start) || !take_char(s, '-') || !take_hex(s, m.end) || !take_char(s, ' '))
    return false;
  size_t sp = s.find(' ');
  if (sp == std::string_view::npos || sp == 0) return false;
  m.perms = std::string(s.substr(0, sp));
  s.remove_prefix(sp + 1);
  if (!take_hex(s, m.offset) || !take_char(s, ' ') || !take_hex(s, maj) || !take_char(s, ':') ||
      !take_hex(s, min) || !take_char(s, ' ') || !take_dec(s, m.inode))
    return false;
  m.dev = makedev(static_cast<unsigned>(maj), static_cast<unsigned>(min));
  skip_spaces(s);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.remove_suffix(1);
  m.path = std::string(s);
  return m.end > m.start;
}

std::vector<Mapping> parse_maps(std::string_view text) {
  std::vector<Mapping> out;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    Mapping m;
    if (parse_maps_line(line, m)) out.push_back(std::move(m));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return out;
}

Result<std::vector<Mapping>> read_maps(pid_t pid) {
  std::string path = "/proc/" + std::to_string(pid) + "/maps";
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Error::sys("open " + path);
  std::string text;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Error::sys("read " + path);
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  return parse_maps(text);
}

std::string openable_path(pid_t pid, const Mapping& m) {
  struct stat st {};
  if (!m.path.empty() && m.path[0] == '/' && stat(m.path.c_str(), &st) == 0 && st.st_ino == m.inode &&
      st.st_dev == m.dev)
    return m.path;
  std::string root = "/proc/" + std::to_string(pid) + "/root" + m.path;
  if (stat(root.c_str(), &st) == 0 && st.st_ino == m.inode && st.st_dev == m.dev) return root;
  char buf[96];
  snprintf(buf, sizeof buf, "/proc/%d/map_files/%" PRIx64 "-%" PRIx64, pid, m.start, m.end);
  return buf;
}

}  // namespace memtrace::procfs
