#include "loader/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string_view>

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

Result<OutputDir> open_output_dir(const std::string& path) {
  if (path.empty()) return Error::msg("empty directory name");
  // mkdir -p: each missing component in turn (an existing one, even a link
  // to a directory, is taken as it is).
  for (size_t at = path.find('/', 1);; at = path.find('/', at + 1)) {
    std::string part = path.substr(0, at);
    if (!part.empty() && part.back() != '/' && mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      return Error::sys("cannot create directory " + part);
    if (at == std::string::npos) break;
  }
  OutputDir d;
  d.path = path;
  d.fd = Fd(open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!d.fd.valid()) {
    if (errno == ENOTDIR) return Error::msg("not a directory");
    return Error::sys("cannot open it");
  }
  std::string probe = ".memtrace-bpf-probe." + std::to_string(getpid());
  unlinkat(d.fd.get(), probe.c_str(), 0);  // a previous run's, killed at this moment
  Fd f(openat(d.fd.get(), probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!f.valid()) return Error::sys("cannot create files in it");
  unlinkat(d.fd.get(), probe.c_str(), 0);
  return d;
}

Result<void> write_output_atomic(const OutputDir& dir, const std::string& name, const std::string& data,
                                 Privacy privacy) {
  std::string tmp = "." + name + ".tmp";
  std::string shown = dir.path + "/" + name;
  // O_EXCL: a leftover of a killed run (or anything else at that name) is
  // removed first, never written through.
  unlinkat(dir.fd.get(), tmp.c_str(), 0);
  Fd fd(openat(dir.fd.get(), tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
               privacy == Privacy::Private ? 0600 : 0644));
  if (!fd.valid()) return Error::sys("cannot write " + dir.path + "/" + tmp);
  auto fail = [&](const char* what) {
    Error e = Error::sys(what + shown);
    unlinkat(dir.fd.get(), tmp.c_str(), 0);
    return e;
  };
  std::string_view left = data;
  while (!left.empty()) {
    ssize_t n = write(fd.get(), left.data(), left.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("cannot write ");
    left.remove_prefix(static_cast<size_t>(n));
  }
  if (close(fd.release()) != 0) return fail("cannot write ");
  if (renameat(dir.fd.get(), tmp.c_str(), dir.fd.get(), name.c_str()) != 0) return fail("cannot rename into ");
  return {};
}

}  // namespace memtrace::loader
