// MiniDebugInfo: the .gnu_debugdata section that Fedora, RHEL and others leave
// in stripped binaries, an xz-compressed ELF file holding the .symtab entries
// .dynsym lacks (static functions), so that stacks name them without a debug
// file. Decompressed with liblzma, bounded in size and memory.
#pragma once
#include <memory>

#include "common/result.h"
#include "elf/image.h"

namespace memtrace::symbolize {

// The embedded ELF of img's .gnu_debugdata; nullptr when there is none.
// An error names what was wrong with it (not xz, too large, not ELF).
Result<std::unique_ptr<elf::Image>> open_minidebuginfo(const elf::Image& img);

}  // namespace memtrace::symbolize
