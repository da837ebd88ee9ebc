#include "loader/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace memtrace::loader {

Result<std::unique_ptr<std::ofstream>> open_output(const std::string& path, Privacy privacy,
                                                   std::ios::openmode mode) {
  mode_t perm = privacy == Privacy::Private ? 0600 : 0644;
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, perm);
  if (fd < 0) {
    if (errno == ELOOP)
      return Error::msg("cannot write " + path + ": it is a symbolic link (name the file it points to)");
    return Error::sys("cannot write " + path);
  }
  struct stat st;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    // An existing file keeps its owner but not wider permissions than asked.
    if (privacy == Privacy::Private && (st.st_mode & 077)) fchmod(fd, 0600);
    if (ftruncate(fd, 0) != 0) {
      int e = errno;
      close(fd);
      return Error::sys("cannot truncate " + path, e);
    }
  }
  // The stream opens the file this descriptor holds, not the path again
  // (which could have been replaced by a link since).
  auto f = std::make_unique<std::ofstream>("/proc/self/fd/" + std::to_string(fd), mode | std::ios::out);
  int e = errno;
  close(fd);
  if (!*f) return Error::sys("cannot write " + path, e);
  return f;
}

}  // namespace memtrace::loader
