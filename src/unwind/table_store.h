// Tables shared by every process: one CfiTable per file, found by device +
// inode (no need to open the file again) or by build-id (the same file seen
// through another path, mount namespace or copy).
#pragma once
#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "unwind/cfi_table.h"

namespace memtrace::unwind {

class TableStore {
 public:
  // The table of the file open at `fd` (`what` names it in errors); dev/ino
  // from fstat. Built once.
  Result<std::shared_ptr<const CfiTable>> get(int fd, const std::string& what);

  size_t files() const { return by_inode_.size(); }
  size_t tables() const { return by_build_id_.size() + anonymous_; }

 private:
  std::map<std::pair<dev_t, ino_t>, std::shared_ptr<const CfiTable>> by_inode_;
  std::map<std::string, std::shared_ptr<const CfiTable>> by_build_id_;
  size_t anonymous_ = 0;
};

}  // namespace memtrace::unwind
