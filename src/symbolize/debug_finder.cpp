#include "symbolize/debug_finder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "symbolize/debuginfod.h"

namespace memtrace::symbolize {
namespace {

constexpr size_t kMaxIndexedFiles = 200'000;

bool usable_debug(const elf::Image& d) { return d.has_dwarf() || d.has_symtab(); }

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (a.back() == '/') return a + b;
  return a + "/" + b;
}

// Whether path starts with the ELF magic (cheap test before libelf).
bool looks_like_elf(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  char m[4] = {};
  ssize_t n = ::pread(fd, m, 4, 0);
  ::close(fd);
  return n == 4 && m[0] == 0x7f && m[1] == 'E' && m[2] == 'L' && m[3] == 'F';
}

}  // namespace

std::string check_symbol_dirs(const std::vector<std::string>& dirs) {
  for (const auto& d : dirs) {
    struct stat st;
    if (::stat(d.c_str(), &st) != 0) return "--symbols " + d + ": " + std::strerror(errno);
    if (!S_ISDIR(st.st_mode)) return "--symbols " + d + ": not a directory";
    if (::access(d.c_str(), R_OK | X_OK) != 0) return "--symbols " + d + ": " + std::strerror(errno);
  }
  return "";
}

DebugFinder::DebugFinder(const Options& opts)
    : symbol_dirs_(opts.symbol_dirs),
      debug_root_(opts.debug_root),
      debuginfod_(opts.debuginfod),
      indexes_(opts.symbol_dirs.size()) {}

std::unique_ptr<elf::Image> DebugFinder::try_build_id(const std::string& path, const std::string& build_id) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return nullptr;
  auto r = elf::Image::open(path);
  if (!r) return nullptr;
  auto img = std::move(r).value();
  if (img->build_id() != build_id || !usable_debug(*img)) return nullptr;
  return img;
}

std::unique_ptr<elf::Image> DebugFinder::try_debuglink(const std::string& path, const elf::Image& main) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return nullptr;
  auto r = elf::Image::open(path);
  if (!r) return nullptr;
  auto img = std::move(r).value();
  if (!usable_debug(*img)) return nullptr;
  if (!main.build_id().empty() && !img->build_id().empty() && img->build_id() != main.build_id())
    return nullptr;
  auto crc = elf::file_crc32(img->fd());
  if (!crc || *crc != main.debuglink()->crc) return nullptr;
  return img;
}

const std::unordered_map<std::string, std::string>& DebugFinder::dir_index(size_t i) {
  if (indexes_[i]) return *indexes_[i];
  auto& idx = indexes_[i].emplace();
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::recursive_directory_iterator it(symbol_dirs_[i], fs::directory_options::skip_permission_denied, ec);
  size_t seen = 0;
  for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (++seen > kMaxIndexedFiles) break;
    std::error_code e2;
    if (!it->is_regular_file(e2) || it->is_symlink(e2)) continue;
    std::string p = it->path().string();
    if (!looks_like_elf(p)) continue;
    auto r = elf::Image::open(p);
    if (!r || (*r)->build_id().empty() || !usable_debug(**r)) continue;
    // Prefer a .debug file (or anything with DWARF) over a plain binary.
    auto [pos, inserted] = idx.emplace((*r)->build_id(), p);
    if (!inserted && (*r)->has_dwarf()) pos->second = p;
  }
  return idx;
}

std::unique_ptr<elf::Image> DebugFinder::find(const elf::Image& img, const std::string& dir,
                                            const std::string& logical_dir) {
  const std::string& bid = img.build_id();
  if (!bid.empty()) {
    std::string h = img.build_id_hex();
    std::string rel = ".build-id/" + h.substr(0, 2) + "/" + h.substr(2);
    for (size_t i = 0; i < symbol_dirs_.size(); ++i) {
      if (auto d = try_build_id(join(symbol_dirs_[i], rel + ".debug"), bid)) return d;
      if (auto d = try_build_id(join(symbol_dirs_[i], rel), bid)) return d;
      const auto& idx = dir_index(i);
      if (auto it = idx.find(bid); it != idx.end())
        if (auto d = try_build_id(it->second, bid)) return d;
    }
    if (!debug_root_.empty())
      if (auto d = try_build_id(join(debug_root_, rel + ".debug"), bid)) return d;
  }
  if (const auto& dl = img.debuglink()) {
    std::vector<std::string> cands;
    if (!dir.empty()) {
      cands.push_back(join(dir, dl->name));
      cands.push_back(join(join(dir, ".debug"), dl->name));
    }
    if (!debug_root_.empty() && !logical_dir.empty() && logical_dir[0] == '/')
      cands.push_back(join(debug_root_ + logical_dir, dl->name));
    // --symbols DIR/NAME too: the CRC is a content match, not a path match.
    for (const auto& s : symbol_dirs_) cands.push_back(join(s, dl->name));
    for (const auto& c : cands) {
      if (c == img.path()) continue;
      if (auto d = try_debuglink(c, img)) return d;
    }
  }
  if (!deferred_ && would_ask_debuginfod(img)) {
    auto got = Debuginfod::get().find(bid, "debuginfo", img.path());
    if (got.fd.valid()) {
      auto r = elf::Image::open_fd(std::move(got.fd), got.path);
      if (r && (*r)->build_id() == bid && usable_debug(**r)) return std::move(r).value();
    }
  }
  return nullptr;
}

bool DebugFinder::would_ask_debuginfod(const elf::Image& img) const {
  return !img.build_id().empty() && debuginfod_ && Debuginfod::get().active();
}

}  // namespace memtrace::symbolize
