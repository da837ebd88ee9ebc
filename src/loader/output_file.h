// Every file the tool writes (-o reports, --record recordings, --pprof-dir
// profiles) is opened here: never through a symlink the user did not name
// (O_NOFOLLOW on the last component: a root tool writing into /tmp must not
// be redirected to /etc/shadow), and 0600 when it holds memory contents
// (--dump-bytes reports, recordings).
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

// A directory the tool writes files into by name (--pprof-dir): created if
// missing, with its parents (0755, as mkdir -p), and proven writable by
// creating and removing a file in it (root passes every permission check,
// not a read-only file system). The directory itself may be a link the
// user named; the files in it never are.
struct OutputDir {
  Fd fd;
  std::string path;
};
// Errors name what failed, for "PATH: " to go before them: "not a directory",
// "cannot create directory /x/y: Permission denied", "cannot create files in it: Read-only file system".
Result<OutputDir> open_output_dir(const std::string& path);
// data as DIR/name, atomically: written to ".name.tmp" in DIR (created
// exclusively: never through a link, never someone else's file), then
// renamed over name. A reader of name sees the previous file or the whole
// new one, never part of it; a failure leaves no temporary behind.
Result<void> write_output_atomic(const OutputDir& dir, const std::string& name, const std::string& data,
                                 Privacy privacy);

}  // namespace memtrace::loader
