// libFuzzer target for src/symbolize and the ELF reader under it (src/elf):
// the input is an ELF file (seeded with real ones), mapped and symbolized
// through the public API the loader uses, and searched for an allocator as
// the loader's elf::ElfFile does. Any crash, hang, leak or runaway
// allocation is a bug.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "elf/elf_file.h"
#include "symbolize/symbolize.h"

using namespace memtrace::symbolize;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int fd = memfd_create("fuzz-elf", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t off = 0;
  while (off < size) {
    ssize_t n = write(fd, data + off, size - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  std::string path = "/proc/self/fd/" + std::to_string(fd);
  {
    Options o;
    o.debug_root = "/nonexistent";  // no file-system lookups outside the input
    o.debuginfod = false;           // nor network ones
    Symbolizer sym(o);
    AddressSpace as;
    MappingInfo m;
    m.start = 0x10000000;
    m.end = m.start + ((size + 0xfff) & ~size_t{0xfff}) + 0x1000;
    m.perms = "r-xp";
    m.path = "/fuzz/input";
    sym.add_mapping(as, m, path);
    (void)sym.add_file(as, path, 0x400000000000);
    // Addresses: spread over the mapping and the file's own vaddr space.
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < size && i < 64; ++i) h = (h ^ data[i]) * 1099511628211ull;
    for (int k = 0; k < 24; ++k) {
      h = h * 6364136223846793005ull + 1442695040888963407ull;
      uint64_t span = size ? size : 1;
      (void)sym.symbolize(as, m.start + (h >> 16) % span, k & 1);
      (void)sym.symbolize(as, 0x400000000000 + (h >> 8) % (span * 4), k & 2);
    }
  }
  if (auto f = memtrace::elf::ElfFile::open(path)) {
    for (const char* name : {"malloc", "free", "main", "_start"})
      if (auto s = f->find_function(name)) (void)f->read_vaddr(s->vaddr, 64);
    (void)f->find_object("stdout");
    (void)f->imports("aligned_alloc");
    for (const auto& s : f->symbols())
      if (s.size) (void)f->read_vaddr(s.vaddr + s.size - 1, 16);
  }
  close(fd);
  return 0;
}
