// One ELF file opened through libelf, read defensively: every size and offset
// taken from the file is checked before use, so a truncated or corrupted file
// gives an error value, never a crash. Symbolization-specific (load segments,
// build-id, .gnu_debuglink, function symbols); the general-purpose reader used
// by the loader is src/elf.
#pragma once
#include <libelf.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/fd.h"
#include "common/result.h"

namespace memtrace::symbolize {

struct LoadSegment {
  uint64_t vaddr = 0, memsz = 0, offset = 0, filesz = 0, align = 0;
  uint32_t flags = 0;
};

struct DebugLink {
  std::string name;  // file name, no directory
  uint32_t crc = 0;  // CRC-32 of the whole debug file
};

// A function symbol, sorted by address in SymbolTable.
struct SymbolEntry {
  uint64_t addr = 0, size = 0;
  uint32_t name = 0;  // offset in SymbolTable::names
  uint8_t rank = 0;   // preference among symbols at one address (higher wins)
};

class SymbolTable {
 public:
  void add(uint64_t addr, uint64_t size, std::string_view name, uint8_t rank);
  void finish();  // sort + dedupe; call once after the adds
  // The symbol whose size covers vaddr, else the nearest one below it (the
  // caller bounds that by the code section).
  const SymbolEntry* find(uint64_t vaddr) const;
  const char* name(const SymbolEntry& e) const { return names_.data() + e.name; }
  size_t size() const { return syms_.size(); }

 private:
  std::vector<SymbolEntry> syms_;
  std::string names_;
};

class ElfImage {
 public:
  // Takes ownership of fd; path is only for messages and debuglink search.
  static Result<std::unique_ptr<ElfImage>> open_fd(Fd fd, std::string path);
  static Result<std::unique_ptr<ElfImage>> open_path(const std::string& path);
  // An image in memory (fuzzer, tests): the bytes are owned by the image.
  static Result<std::unique_ptr<ElfImage>> from_memory(std::string bytes, std::string name);
  ~ElfImage();
  ElfImage(const ElfImage&) = delete;
  ElfImage& operator=(const ElfImage&) = delete;

  Elf* elf() const { return elf_; }
  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  uint16_t type() const { return type_; }
  const std::string& build_id() const { return build_id_; }  // raw bytes, "" if none
  std::string build_id_hex() const;
  const std::optional<DebugLink>& debuglink() const { return debuglink_; }
  const std::vector<LoadSegment>& loads() const { return loads_; }
  bool has_dwarf() const { return has_dwarf_; }     // .debug_info present (maybe compressed)
  bool has_symtab() const { return has_symtab_; }
  bool is_debug_only() const { return debug_only_; }  // code sections are NOBITS (a .debug file)
  // The raw bytes of .gnu_debugdata (MiniDebugInfo: an xz-compressed ELF
  // holding .symtab), empty if none. Valid while the image lives.
  std::string_view gnu_debugdata() const;

  // File offset inside a PT_LOAD -> link-time vaddr. Covers the page-aligned
  // head of a segment too (a mapping starts at p_offset rounded down).
  std::optional<uint64_t> offset_to_vaddr(uint64_t off) const;
  // End of the code section (else PT_LOAD) containing vaddr: bounds zero-sized
  // symbols (_init must not swallow .plt).
  uint64_t exec_end(uint64_t vaddr) const;

  // Append function symbols of .symtab (and .dynsym when dynsym = true).
  void collect_symbols(SymbolTable& out, bool symtab, bool dynsym) const;

  // Sections whose declared decompressed size is absurd (a zip bomb) make the
  // DWARF unusable: checked before libdw decompresses anything.
  bool compressed_sections_sane() const;

 private:
  ElfImage() = default;
  Result<void> init();

  Fd fd_;
  std::string mem_;  // backing bytes for from_memory
  Elf* elf_ = nullptr;
  std::string path_;
  uint64_t file_size_ = 0;
  uint16_t type_ = 0;
  std::string build_id_;
  std::optional<DebugLink> debuglink_;
  std::vector<LoadSegment> loads_;
  std::vector<std::pair<uint64_t, uint64_t>> code_sections_;  // [addr, end)
  bool has_dwarf_ = false, has_symtab_ = false, debug_only_ = false;
  Elf_Scn* gnu_debugdata_ = nullptr;
};

std::string hex(const std::string& bytes);
// CRC-32 (IEEE, as .gnu_debuglink uses) of a whole file; nullopt on read error.
std::optional<uint32_t> file_crc32(int fd);

}  // namespace memtrace::symbolize
