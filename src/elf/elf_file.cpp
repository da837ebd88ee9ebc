#include "elf/elf_file.h"

#include <elf.h>
#include <fcntl.h>
#include <gelf.h>
#include <libelf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>

#include "common/fd.h"

namespace memtrace::elf {
namespace {

struct ElfCloser {
  void operator()(Elf* e) const { elf_end(e); }
};

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; i++) {
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

}  // namespace

Result<ElfFile> ElfFile::open(const std::string& path) {
  elf_version(EV_CURRENT);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Error::sys("open " + path);
  struct stat st{};
  if (fstat(fd.get(), &st) != 0) return Error::sys("stat " + path);
  ElfFile f;
  f.path_ = path;
  f.data_.resize(st.st_size);
  size_t got = 0;
  while (got < f.data_.size()) {
    ssize_t n = pread(fd.get(), f.data_.data() + got, f.data_.size() - got, got);
    if (n < 0) return Error::sys("read " + path);
    if (n == 0) break;
    got += n;
  }
  f.data_.resize(got);
  std::unique_ptr<Elf, ElfCloser> e(elf_memory(f.data_.data(), f.data_.size()));
  if (!e || elf_kind(e.get()) != ELF_K_ELF)
    return Error::msg(path + ": not an ELF file");
  GElf_Ehdr eh;
  if (!gelf_getehdr(e.get(), &eh)) return Error::msg(path + ": bad ELF header");
  f.e_type_ = eh.e_type;

  size_t nph = 0;
  if (elf_getphdrnum(e.get(), &nph) != 0) return Error::msg(path + ": bad program headers");
  for (size_t i = 0; i < nph; i++) {
    GElf_Phdr ph;
    if (!gelf_getphdr(e.get(), i, &ph)) continue;
    if (ph.p_type == PT_LOAD)
      f.segments_.push_back({ph.p_vaddr, ph.p_memsz, ph.p_offset, ph.p_filesz, ph.p_flags});
    if (ph.p_type == PT_NOTE && ph.p_offset + ph.p_filesz <= f.data_.size()) {
      // Walk notes for NT_GNU_BUILD_ID.
      const uint8_t* p = reinterpret_cast<const uint8_t*>(f.data_.data()) + ph.p_offset;
      size_t left = ph.p_filesz;
      while (left >= 12 && f.build_id_.empty()) {
        uint32_t namesz, descsz, type;
        memcpy(&namesz, p, 4);
        memcpy(&descsz, p + 4, 4);
        memcpy(&type, p + 8, 4);
        size_t nsz = (namesz + 3) & ~3u, dsz = (descsz + 3) & ~3u;
        if (12 + nsz + dsz > left || nsz < namesz || dsz < descsz) break;
        if (type == NT_GNU_BUILD_ID && namesz == 4 && memcmp(p + 12, "GNU", 4) == 0)
          f.build_id_ = hex(p + 12 + nsz, descsz);
        p += 12 + nsz + dsz;
        left -= 12 + nsz + dsz;
      }
    }
  }

  Elf_Scn* scn = nullptr;
  while ((scn = elf_nextscn(e.get(), scn)) != nullptr) {
    GElf_Shdr sh;
    if (!gelf_getshdr(scn, &sh)) continue;
    if (sh.sh_type != SHT_SYMTAB && sh.sh_type != SHT_DYNSYM) continue;
    bool dynamic = sh.sh_type == SHT_DYNSYM;
    if (!dynamic) f.has_symtab_ = true;
    Elf_Data* data = elf_getdata(scn, nullptr);
    if (!data || sh.sh_entsize == 0) continue;
    size_t n = sh.sh_size / sh.sh_entsize;
    for (size_t i = 0; i < n; i++) {
      GElf_Sym s;
      if (!gelf_getsym(data, i, &s)) break;
      if (dynamic && s.st_shndx == SHN_UNDEF && s.st_name != 0) {
        if (const char* name = elf_strptr(e.get(), sh.sh_link, s.st_name); name && *name) {
          std::string n = name;
          if (auto at = n.find('@'); at != std::string::npos) n.resize(at);
          f.imports_.insert(std::move(n));
        }
      }
      if (s.st_shndx == SHN_UNDEF || s.st_value == 0) continue;
      uint8_t type = GELF_ST_TYPE(s.st_info);
      if (type != STT_FUNC && type != STT_GNU_IFUNC && type != STT_OBJECT && type != STT_TLS)
        continue;
      const char* name = elf_strptr(e.get(), sh.sh_link, s.st_name);
      if (!name || !*name) continue;
      Symbol sym;
      sym.name = name;
      if (auto at = sym.name.find('@'); at != std::string::npos) sym.name.resize(at);
      sym.vaddr = s.st_value;
      sym.size = s.st_size;
      sym.type = type;
      sym.bind = GELF_ST_BIND(s.st_info);
      sym.dynamic = dynamic;
      sym.file_offset = f.vaddr_to_offset(s.st_value).value_or(0);
      f.by_name_[sym.name].push_back(f.symbols_.size());
      f.symbols_.push_back(std::move(sym));
    }
  }
  return f;
}

static std::optional<Symbol> find_kind(const ElfFile& f,
                                       const std::unordered_map<std::string, std::vector<size_t>>& idx,
                                       std::string_view name, bool func) {
  auto it = idx.find(std::string(name));
  if (it == idx.end()) return std::nullopt;
  const Symbol* best = nullptr;
  for (size_t i : it->second) {
    const Symbol& s = f.symbols()[i];
    bool is_func = s.type == STT_FUNC || s.type == STT_GNU_IFUNC;
    if (is_func != func) continue;
    if (!best || (best->dynamic && !s.dynamic) ||
        (best->bind == STB_LOCAL && s.bind != STB_LOCAL))
      best = &s;
  }
  if (!best) return std::nullopt;
  return *best;
}

std::optional<Symbol> ElfFile::find_function(std::string_view name) const {
  return find_kind(*this, by_name_, name, true);
}
std::optional<Symbol> ElfFile::find_object(std::string_view name) const {
  return find_kind(*this, by_name_, name, false);
}

std::optional<uint64_t> ElfFile::vaddr_to_offset(uint64_t vaddr) const {
  for (const auto& s : segments_)
    if (vaddr >= s.vaddr && vaddr < s.vaddr + s.filesz) return vaddr - s.vaddr + s.offset;
  return std::nullopt;
}

std::vector<uint8_t> ElfFile::read_vaddr(uint64_t vaddr, size_t len) const {
  for (const auto& s : segments_) {
    if (vaddr >= s.vaddr && vaddr < s.vaddr + s.filesz) {
      uint64_t off = vaddr - s.vaddr + s.offset;
      size_t n = std::min<uint64_t>(len, s.vaddr + s.filesz - vaddr);
      if (off + n > data_.size()) n = off < data_.size() ? data_.size() - off : 0;
      return std::vector<uint8_t>(data_.begin() + off, data_.begin() + off + n);
    }
  }
  return {};
}

}  // namespace memtrace::elf
