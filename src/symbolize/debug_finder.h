// Finds the separate debug file of a module: --symbols dirs first (matched
// by build-id, whatever the layout below them), then DEBUG_ROOT/.build-id/
// xx/yyyy.debug, then .gnu_debuglink (next to the file, in .debug/, under
// DEBUG_ROOT/DIR) with its CRC checked, then debuginfod (DEBUGINFOD_URLS) by
// build-id. A file found by build-id must carry that build-id: nothing is
// matched by path alone.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "elf/image.h"
#include "symbolize/symbolize.h"

namespace memtrace::symbolize {

class DebugFinder {
 public:
  explicit DebugFinder(const Options& opts);

  // dir: directory of the module as this process can reach it now (for
  // debuglink; may be under /proc/PID/root); logical_dir: the directory as the
  // target saw it (for DEBUG_ROOT/DIR). Either may be "".
  std::unique_ptr<elf::Image> find(const elf::Image& img, const std::string& dir,
                                 const std::string& logical_dir);
  // While deferred, find() does not ask debuginfod; would_ask_debuginfod() says
  // whether it would have (the file has a build-id and debuginfod is on).
  void set_deferred(bool d) { deferred_ = d; }
  bool would_ask_debuginfod(const elf::Image& img) const;

 private:
  std::unique_ptr<elf::Image> try_build_id(const std::string& path, const std::string& build_id);
  std::unique_ptr<elf::Image> try_debuglink(const std::string& path, const elf::Image& img);
  const std::unordered_map<std::string, std::string>& dir_index(size_t i);

  std::vector<std::string> symbol_dirs_;
  std::string debug_root_;
  bool debuginfod_ = true;
  bool deferred_ = false;
  std::vector<std::optional<std::unordered_map<std::string, std::string>>> indexes_;
};

}  // namespace memtrace::symbolize
