#include "elf/elf_file.h"

#include <elf.h>

#include <algorithm>

namespace memtrace::elf {

Result<ElfFile> ElfFile::open(const std::string& path) {
  auto img = Image::open(path);
  if (!img) return img.error();
  ElfFile f;
  f.image_ = std::move(img).value();
  f.build_id_ = f.image_->build_id_hex();
  f.all_ = std::make_unique<Materialized>();
  f.image_->for_each_symbol(true, true, [&f](const SymbolRecord& s) {
    if (s.name.empty()) return;
    std::string_view name = s.name.substr(0, s.name.find('@'));
    if (s.dynamic && s.shndx == SHN_UNDEF && !name.empty()) f.imports_.insert(name);
    if (s.shndx == SHN_UNDEF || s.value == 0) return;
    if (s.type != STT_FUNC && s.type != STT_GNU_IFUNC && s.type != STT_OBJECT && s.type != STT_TLS) return;
    if (f.entries_.size() >= UINT32_MAX) return;
    auto at = static_cast<uint32_t>(f.entries_.size());
    f.entries_.push_back(Entry{name, s.value, s.size, s.type, s.bind, s.dynamic});
    auto [it, fresh] = f.by_name_.try_emplace(name, Chain{at, at});
    if (!fresh) f.entries_[std::exchange(it->second.last, at)].next = at;
  });
  return f;
}

Symbol ElfFile::make_symbol(const Entry& e) const {
  Symbol s;
  s.name = e.name;
  s.vaddr = e.vaddr;
  s.size = e.size;
  s.type = e.type;
  s.bind = e.bind;
  s.dynamic = e.dynamic;
  s.file_offset = vaddr_to_offset(e.vaddr).value_or(0);
  return s;
}

const std::vector<Symbol>& ElfFile::symbols() const {
  std::call_once(all_->once, [this] {
    all_->symbols.reserve(entries_.size());
    for (const Entry& e : entries_) all_->symbols.push_back(make_symbol(e));
  });
  return all_->symbols;
}

std::optional<Symbol> ElfFile::find_kind(std::string_view name, bool func) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  const Entry* best = nullptr;
  for (uint32_t i = it->second.first; i != UINT32_MAX; i = entries_[i].next) {
    const Entry& s = entries_[i];
    bool is_func = s.type == STT_FUNC || s.type == STT_GNU_IFUNC;
    if (is_func != func) continue;
    if (!best || (best->dynamic && !s.dynamic) || (best->bind == STB_LOCAL && s.bind != STB_LOCAL)) best = &s;
  }
  if (!best) return std::nullopt;
  return make_symbol(*best);
}

std::optional<Symbol> ElfFile::find_function(std::string_view name) const { return find_kind(name, true); }
std::optional<Symbol> ElfFile::find_object(std::string_view name) const { return find_kind(name, false); }

std::optional<uint64_t> ElfFile::vaddr_to_offset(uint64_t vaddr) const {
  for (const auto& s : segments())
    if (vaddr >= s.vaddr && vaddr < s.vaddr + s.filesz) return vaddr - s.vaddr + s.offset;
  return std::nullopt;
}

std::vector<uint8_t> ElfFile::read_vaddr(uint64_t vaddr, size_t len) const {
  for (const auto& s : segments()) {
    if (vaddr >= s.vaddr && vaddr < s.vaddr + s.filesz) {
      std::string_view b = image_->bytes(vaddr - s.vaddr + s.offset, std::min<uint64_t>(len, s.vaddr + s.filesz - vaddr));
      return std::vector<uint8_t>(b.begin(), b.end());
    }
  }
  return {};
}

}  // namespace memtrace::elf
