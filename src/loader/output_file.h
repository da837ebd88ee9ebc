// Every file the tool writes (-o reports, --record recordings) is opened
// here: never through a symlink the user did not name (O_NOFOLLOW on the
// last component: a root tool writing into /tmp must not be redirected to
// /etc/shadow), and 0600 when it holds memory contents (--dump-bytes
// reports, recordings).
#pragma once
#include <fstream>
#include <ios>
#include <memory>
#include <string>

#include "common/fd.h"
#include "common/result.h"

namespace memtrace::loader {

enum class Privacy { Shared, Private };  // 0644, or 0600: memory contents

// "cannot write FILE: it is a symbolic link (name the file it points to)".
Result<std::unique_ptr<std::ofstream>> open_output(const std::string& path, Privacy privacy,
                                                   std::ios::openmode mode = std::ios::out);
// The same checks; the file, created or truncated, as a descriptor: a stream
// of the caller's opens "/proc/self/fd/N" (fd_path) while it is open.
Result<Fd> create_output(const std::string& path, Privacy privacy);
inline std::string fd_path(const Fd& fd) { return "/proc/self/fd/" + std::to_string(fd.get()); }

}  // namespace memtrace::loader
