// The one ELF reader: a file opened through libelf (mapped, never read whole)
// or bytes in memory, read defensively: every size and offset taken from the
// file is checked before use, so a truncated or corrupted file gives an error
// value or an empty answer, never a crash. Its load segments, build-id (the
// one notes parser), .gnu_debuglink, code sections, DWARF presence,
// .gnu_debugdata and symbol tables; the Elf* for libdw and the CFI reader.
// Users: elf::ElfFile (the loader's allocator search and probe placement), the
// symbolizer (src/symbolize), the CFI tables (src/unwind), recordings'
// build-ids (src/loader/recording).
#pragma once
#include <libelf.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/fd.h"
#include "common/result.h"

namespace memtrace::elf {

// A PT_LOAD whose file image lies inside the file.
struct Segment {
  uint64_t vaddr = 0, memsz = 0, offset = 0, filesz = 0, align = 0;
  uint32_t flags = 0;  // PF_X | PF_W | PF_R
};

struct DebugLink {
  std::string name;  // file name, no directory
  uint32_t crc = 0;  // CRC-32 of the whole debug file
};

// One entry of .symtab or .dynsym as the file has it. name (which may end in
// "@VERSION") points into the image: valid while the Image lives.
struct SymbolRecord {
  std::string_view name;
  uint64_t value = 0, size = 0;
  uint16_t shndx = 0;
  uint8_t type = 0, bind = 0;  // STT_*, STB_*
  bool dynamic = false;        // from .dynsym
};

class Image {
 public:
  static Result<std::unique_ptr<Image>> open(const std::string& path);
  // Takes ownership of fd; path is only for messages and debuglink search.
  static Result<std::unique_ptr<Image>> open_fd(Fd fd, std::string path);
  // An image in memory (MiniDebugInfo, fuzzer, tests): the bytes are owned by the image.
  static Result<std::unique_ptr<Image>> from_memory(std::string bytes, std::string name);
  ~Image();
  Image(const Image&) = delete;
  Image& operator=(const Image&) = delete;

  Elf* elf() const { return elf_; }
  int fd() const { return fd_.get(); }  // -1 for an image in memory
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  uint16_t type() const { return type_; }        // ET_EXEC / ET_DYN ...
  uint16_t machine() const { return machine_; }  // EM_X86_64 ...
  const std::string& build_id() const { return build_id_; }  // raw bytes, "" if none
  std::string build_id_hex() const;                          // "" if none
  const std::optional<DebugLink>& debuglink() const { return debuglink_; }
  const std::vector<Segment>& segments() const { return segments_; }
  const std::string& interp() const { return interp_; }  // PT_INTERP (the program's ld.so), "" if none
  // DT_RUNPATH, else DT_RPATH, as the file has it (colon-separated, $ORIGIN
  // not expanded), "" if none.
  const std::string& search_path() const { return search_path_; }
  bool has_dwarf() const { return has_dwarf_; }  // .debug_info present (maybe compressed)
  bool has_symtab() const { return has_symtab_; }
  bool is_debug_only() const { return debug_only_; }  // code sections are NOBITS (a .debug file)
  // The raw bytes of .gnu_debugdata (MiniDebugInfo: an xz-compressed ELF
  // holding .symtab), empty if none. Valid while the image lives.
  std::string_view gnu_debugdata() const;

  // The file's bytes [offset, offset + len), fewer where the file ends.
  // Valid while the image lives.
  std::string_view bytes(uint64_t offset, uint64_t len) const;
  // File offset inside a PT_LOAD -> link-time vaddr. Covers the page-aligned
  // head of a segment too (a mapping starts at p_offset rounded down).
  std::optional<uint64_t> offset_to_vaddr(uint64_t off) const;
  // End of the code section (else PT_LOAD) containing vaddr: bounds zero-sized
  // symbols (_init must not swallow .plt).
  uint64_t exec_end(uint64_t vaddr) const;

  // Every entry of .symtab (symtab = true) and .dynsym (dynsym = true) but
  // the null one, in section order.
  void for_each_symbol(bool symtab, bool dynsym, const std::function<void(const SymbolRecord&)>& fn) const;

  // Sections whose declared decompressed size is absurd (a zip bomb) make the
  // DWARF unusable: checked before libdw (or anyone) decompresses anything.
  bool compressed_sections_sane() const;

 private:
  Image() = default;
  Result<void> init();
  void read_search_path(uint64_t dyn_offset, uint64_t dyn_size);

  Fd fd_;
  std::string mem_;  // backing bytes for from_memory
  Elf* elf_ = nullptr;
  std::string path_;
  uint64_t file_size_ = 0;
  uint16_t type_ = 0, machine_ = 0;
  std::string build_id_;
  std::optional<DebugLink> debuglink_;
  std::vector<Segment> segments_;
  std::string interp_;
  std::string search_path_;
  std::vector<std::pair<uint64_t, uint64_t>> code_sections_;  // [addr, end)
  bool has_dwarf_ = false, has_symtab_ = false, debug_only_ = false;
  Elf_Scn* gnu_debugdata_ = nullptr;
};

// CRC-32 (IEEE, as .gnu_debuglink uses) of a whole file; nullopt on read error.
std::optional<uint32_t> file_crc32(int fd);

}  // namespace memtrace::elf
