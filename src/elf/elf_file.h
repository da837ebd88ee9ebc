// Minimal ELF reader (libelf): symbols, segments, code bytes, build-id.
// Used by the loader (find allocator symbols, uprobe offsets), probe placement
// and the single-step helper (--symbol NAME). Symbolization proper (DWARF,
// inlines, debug files) lives in src/symbolize.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/result.h"

namespace memtrace::elf {

struct Symbol {
  std::string name;          // without "@VERSION"
  uint64_t vaddr = 0;        // st_value
  uint64_t size = 0;         // st_size
  uint64_t file_offset = 0;  // offset in the file of vaddr (what a uprobe wants)
  uint8_t type = 0;          // STT_FUNC, STT_OBJECT, STT_GNU_IFUNC ...
  uint8_t bind = 0;          // STB_GLOBAL, STB_WEAK ...
  bool dynamic = false;      // from .dynsym
};

struct Segment {
  uint64_t vaddr = 0, memsz = 0, offset = 0, filesz = 0;
  uint32_t flags = 0;  // PF_X | PF_W | PF_R
};

class ElfFile {
 public:
  static Result<ElfFile> open(const std::string& path);

  const std::string& path() const { return path_; }
  uint16_t type() const { return e_type_; }  // ET_EXEC / ET_DYN
  const std::string& build_id() const { return build_id_; }  // hex, "" if none
  const std::vector<Segment>& segments() const { return segments_; }
  bool has_symtab() const { return has_symtab_; }

  // Defined symbol by exact name (version suffix ignored). Functions and ifuncs
  // for find_function, data for find_object. .symtab is preferred over .dynsym.
  std::optional<Symbol> find_function(std::string_view name) const;
  std::optional<Symbol> find_object(std::string_view name) const;
  const std::vector<Symbol>& symbols() const { return symbols_; }
  // The object calls or reads `name` from another object (an undefined
  // .dynsym entry, version suffix ignored): "aligned_alloc" in libstdc++.
  bool imports(std::string_view name) const { return imports_.count(std::string(name)) != 0; }

  std::optional<uint64_t> vaddr_to_offset(uint64_t vaddr) const;
  // Bytes of the file image at vaddr (fewer if the segment ends earlier).
  std::vector<uint8_t> read_vaddr(uint64_t vaddr, size_t len) const;

 private:
  std::string path_;
  uint16_t e_type_ = 0;
  std::string build_id_;
  bool has_symtab_ = false;
  std::vector<Segment> segments_;
  std::vector<Symbol> symbols_;
  std::unordered_map<std::string, std::vector<size_t>> by_name_;
  std::unordered_set<std::string> imports_;
  std::string data_;  // whole file, read once (libraries are small enough)
};

}  // namespace memtrace::elf
