#include "unwind/table_store.h"

#include <elf.h>
#include <sys/stat.h>

namespace memtrace::unwind {

Result<std::shared_ptr<const CfiTable>> TableStore::get(int fd, const std::string& what) {
  struct stat st;
  if (fstat(fd, &st) != 0) return Error::sys("stat " + what);
  auto key = std::make_pair(st.st_dev, st.st_ino);
  if (auto it = by_inode_.find(key); it != by_inode_.end()) return it->second;
  auto t = build_cfi_table_fd(fd, what);
  if (!t) return t.error();
  // The BPF walk reads rows with this machine's registers only.
#if defined(__aarch64__)
  constexpr uint16_t kHost = EM_AARCH64;
#else
  constexpr uint16_t kHost = EM_X86_64;
#endif
  if (t->machine != kHost) return Error::msg("CFI tables " + what + ": not this machine's architecture");
  std::shared_ptr<const CfiTable> table;
  if (!t->build_id.empty()) {
    auto& slot = by_build_id_[t->build_id];
    if (!slot) slot = std::make_shared<const CfiTable>(std::move(*t));
    table = slot;
  } else {
    table = std::make_shared<const CfiTable>(std::move(*t));
    anonymous_++;
  }
  by_inode_[key] = table;
  return table;
}

}  // namespace memtrace::unwind
