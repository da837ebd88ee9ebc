// The loader's view of an ELF file (elf::Image underneath: mapped, never read
// whole): symbols by name, segments, code bytes, build-id. Used by the loader
// (find allocator symbols, uprobe offsets), probe placement and the
// single-step helper (--symbol NAME). Symbolization proper (DWARF, inlines,
// debug files) lives in src/symbolize.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/result.h"
#include "elf/image.h"

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

class ElfFile {
 public:
  static Result<ElfFile> open(const std::string& path);

  const std::string& path() const { return image_->path(); }
  uint16_t type() const { return image_->type(); }  // ET_EXEC / ET_DYN
  const std::string& build_id() const { return build_id_; }  // hex, "" if none
  const std::vector<Segment>& segments() const { return image_->segments(); }  // PT_LOAD
  bool has_symtab() const { return image_->has_symtab(); }
  const Image& image() const { return *image_; }

  // Defined symbol by exact name (version suffix ignored). Functions and ifuncs
  // for find_function, data for find_object. .symtab is preferred over .dynsym.
  std::optional<Symbol> find_function(std::string_view name) const;
  std::optional<Symbol> find_object(std::string_view name) const;
  // Every defined function, ifunc, object and TLS symbol, in file order
  // (made on the first call: the loader's searches by name never need it).
  const std::vector<Symbol>& symbols() const;
  // The object calls or reads `name` from another object (an undefined
  // .dynsym entry, version suffix ignored): "aligned_alloc" in libstdc++.
  bool imports(std::string_view name) const { return imports_.count(name) != 0; }

  std::optional<uint64_t> vaddr_to_offset(uint64_t vaddr) const;
  // Bytes of the file image at vaddr (fewer if the segment ends earlier).
  std::vector<uint8_t> read_vaddr(uint64_t vaddr, size_t len) const;

 private:
  // A symbol as the image holds it: its name points into the mapping.
  struct Entry {
    std::string_view name;  // without "@VERSION"
    uint64_t vaddr = 0, size = 0;
    uint8_t type = 0, bind = 0;
    bool dynamic = false;
    uint32_t next = UINT32_MAX;  // the next entry of the same name
  };
  struct Chain {
    uint32_t first = 0, last = 0;
  };
  struct Materialized {
    std::once_flag once;
    std::vector<Symbol> symbols;
  };
  ElfFile() = default;
  std::optional<Symbol> find_kind(std::string_view name, bool func) const;
  Symbol make_symbol(const Entry& e) const;

  std::unique_ptr<Image> image_;
  std::string build_id_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string_view, Chain> by_name_;
  std::unordered_set<std::string_view> imports_;
  std::unique_ptr<Materialized> all_;
};

}  // namespace memtrace::elf
