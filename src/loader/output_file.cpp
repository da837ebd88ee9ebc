#include "loader/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace memtrace::loader {

Result<Fd> create_output(const std::string& path, Privacy privacy) {
  mode_t perm = privacy == Privacy::Private ? 0600 : 0644;
  Fd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, perm));
  if (!fd.valid()) {
    if (errno == ELOOP)
      return Error::msg("cannot write " + path + ": it is a symbolic link (name the file it points to)");
    return Error::sys("cannot write " + path);
  }
  struct stat st;
  if (fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode)) {
    // An existing file keeps its owner but not wider permissions than asked.
    if (privacy == Privacy::Private && (st.st_mode & 077)) fchmod(fd.get(), 0600);
    if (ftruncate(fd.get(), 0) != 0) return Error::sys("cannot truncate " + path);
  }
  return fd;
}

Result<std::unique_ptr<std::ofstream>> open_output(const std::string& path, Privacy privacy,
                                                   std::ios::openmode mode) {
  auto fd = create_output(path, privacy);
  if (!fd) return fd.error();
  // The stream opens the file this descriptor holds, not the path again
  // (which could have been replaced by a link since).
  auto f = std::make_unique<std::ofstream>(fd_path(*fd), mode | std::ios::out);
  if (!*f) return Error::sys("cannot write " + path);
  return f;
}

}  // namespace memtrace::loader
