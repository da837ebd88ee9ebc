#include "elf/image.h"

#include <fcntl.h>
#include <gelf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "common/hex.h"

namespace memtrace::elf {
namespace {

constexpr uint64_t kPage = 4096;
constexpr size_t kMaxBuildId = 64;
// A compressed section may not claim more than this when decompressed, nor
// more than zlib's best ratio (~1032:1) of its compressed size.
constexpr uint64_t kMaxDecompressed = 256ull << 20;
constexpr uint64_t kMaxRatio = 1100;

void init_libelf() {
  static const bool ok = elf_version(EV_CURRENT) != EV_NONE;
  (void)ok;
}

const char* elf_err() { return elf_errmsg(-1) ? elf_errmsg(-1) : "unknown libelf error"; }

// Parse a note buffer, return the GNU build-id descriptor if any.
std::string build_id_from_notes(Elf_Data* data) {
  if (!data || !data->d_buf) return {};
  size_t off = 0;
  GElf_Nhdr nh;
  size_t name_off, desc_off;
  for (int guard = 0; guard < 4096; ++guard) {
    size_t next = gelf_getnote(data, off, &nh, &name_off, &desc_off);
    if (next == 0 || next <= off) break;
    const char* base = static_cast<const char*>(data->d_buf);
    if (nh.n_type == NT_GNU_BUILD_ID && nh.n_namesz == 4 && std::memcmp(base + name_off, "GNU", 4) == 0 &&
        nh.n_descsz > 0 && nh.n_descsz <= kMaxBuildId)
      return std::string(base + desc_off, nh.n_descsz);
    off = next;
  }
  return {};
}

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> r{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      r[i] = c;
    }
    return r;
  }();
  return t;
}

}  // namespace

std::optional<uint32_t> file_crc32(int fd) {
  const auto& t = crc_table();
  uint32_t c = 0xffffffffu;
  std::vector<unsigned char> buf(1 << 20);
  off_t pos = 0;
  for (;;) {
    ssize_t n = ::pread(fd, buf.data(), buf.size(), pos);
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::nullopt;
    }
    if (n == 0) break;
    for (ssize_t i = 0; i < n; ++i) c = t[(c ^ buf[i]) & 0xff] ^ (c >> 8);
    pos += n;
  }
  return c ^ 0xffffffffu;
}

// ---- Image ---------------------------------------------------------------------

Image::~Image() {
  if (elf_) elf_end(elf_);
}

Result<std::unique_ptr<Image>> Image::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Error::sys("open " + path);
  return open_fd(Fd(fd), path);
}

Result<std::unique_ptr<Image>> Image::open_fd(Fd fd, std::string path) {
  init_libelf();
  std::unique_ptr<Image> img(new Image());
  img->path_ = std::move(path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Error::sys("fstat " + img->path_);
  if (!S_ISREG(st.st_mode)) return Error::msg(img->path_ + ": not a regular file");
  img->file_size_ = static_cast<uint64_t>(st.st_size);
  img->elf_ = elf_begin(fd.get(), ELF_C_READ_MMAP, nullptr);
  img->fd_ = std::move(fd);
  if (!img->elf_) return Error::msg("elf_begin " + img->path_ + ": " + elf_err());
  if (auto r = img->init(); !r) return r.error();
  return img;
}

Result<std::unique_ptr<Image>> Image::from_memory(std::string bytes, std::string name) {
  init_libelf();
  std::unique_ptr<Image> img(new Image());
  img->path_ = std::move(name);
  img->mem_ = std::move(bytes);
  img->file_size_ = img->mem_.size();
  img->elf_ = elf_memory(img->mem_.data(), img->mem_.size());
  if (!img->elf_) return Error::msg("elf_memory " + img->path_ + ": " + elf_err());
  if (auto r = img->init(); !r) return r.error();
  return img;
}

std::string Image::build_id_hex() const { return hex_bytes(build_id_); }

Result<void> Image::init() {
  if (elf_kind(elf_) != ELF_K_ELF) return Error::msg(path_ + ": not an ELF file");
  GElf_Ehdr eh;
  if (!gelf_getehdr(elf_, &eh)) return Error::msg(path_ + ": bad ELF header: " + elf_err());
  type_ = eh.e_type;
  machine_ = eh.e_machine;

  size_t nph = 0;
  if (elf_getphdrnum(elf_, &nph) != 0) nph = 0;
  uint64_t dyn_off = 0, dyn_size = 0;
  for (size_t i = 0; i < nph && i < 65536; ++i) {
    GElf_Phdr ph;
    if (!gelf_getphdr(elf_, static_cast<int>(i), &ph)) break;
    if (ph.p_type == PT_LOAD) {
      if (ph.p_offset > file_size_ || ph.p_filesz > file_size_ - ph.p_offset) continue;  // lies
      segments_.push_back({ph.p_vaddr, ph.p_memsz, ph.p_offset, ph.p_filesz, ph.p_align, ph.p_flags});
    } else if (ph.p_type == PT_INTERP && ph.p_filesz > 1 && ph.p_filesz <= 4096 &&
               ph.p_offset <= file_size_ && ph.p_filesz <= file_size_ - ph.p_offset) {
      if (Elf_Data* d = elf_getdata_rawchunk(elf_, static_cast<int64_t>(ph.p_offset), ph.p_filesz, ELF_T_BYTE))
        interp_.assign(static_cast<const char*>(d->d_buf), strnlen(static_cast<const char*>(d->d_buf), d->d_size));
    } else if (ph.p_type == PT_DYNAMIC && ph.p_offset <= file_size_ && ph.p_filesz <= file_size_ - ph.p_offset &&
               ph.p_filesz <= (1u << 20)) {
      dyn_off = ph.p_offset;
      dyn_size = ph.p_filesz;
    } else if (ph.p_type == PT_NOTE && build_id_.empty() && ph.p_filesz > 0 &&
               ph.p_filesz <= (1u << 20)) {
      Elf_Data* d = elf_getdata_rawchunk(elf_, static_cast<int64_t>(ph.p_offset), ph.p_filesz,
                                         ph.p_align == 8 ? ELF_T_NHDR8 : ELF_T_NHDR);
      build_id_ = build_id_from_notes(d);
    }
  }

  if (dyn_size) read_search_path(dyn_off, dyn_size);

  size_t shstrndx = 0;
  bool have_names = elf_getshdrstrndx(elf_, &shstrndx) == 0;
  size_t nsec = 0;
  if (elf_getshdrnum(elf_, &nsec) != 0) nsec = 0;
  Elf_Scn* scn = nullptr;
  for (size_t n = 0; n < nsec && (scn = elf_nextscn(elf_, scn)) != nullptr; ++n) {
    GElf_Shdr sh;
    if (!gelf_getshdr(scn, &sh)) continue;
    const char* name = have_names ? elf_strptr(elf_, shstrndx, sh.sh_name) : nullptr;
    if (!name) name = "";
    if (sh.sh_type == SHT_SYMTAB) has_symtab_ = true;
    if ((sh.sh_flags & SHF_ALLOC) && (sh.sh_flags & SHF_EXECINSTR) && sh.sh_size > 0 &&
        sh.sh_addr + sh.sh_size > sh.sh_addr && code_sections_.size() < 65536)
      code_sections_.emplace_back(sh.sh_addr, sh.sh_addr + sh.sh_size);
    if (!std::strcmp(name, ".debug_info") || !std::strcmp(name, ".zdebug_info")) {
      if (sh.sh_type != SHT_NOBITS && sh.sh_size > 0) has_dwarf_ = true;
    }
    if (!std::strcmp(name, ".text") && sh.sh_type == SHT_NOBITS) debug_only_ = true;
    if (!std::strcmp(name, ".gnu_debugdata") && sh.sh_type == SHT_PROGBITS && sh.sh_size > 0)
      gnu_debugdata_ = scn;
    if (sh.sh_type == SHT_NOTE && build_id_.empty() && sh.sh_type != SHT_NOBITS)
      build_id_ = build_id_from_notes(elf_getdata(scn, nullptr));
    if (!std::strcmp(name, ".gnu_debuglink") && sh.sh_type == SHT_PROGBITS) {
      Elf_Data* d = elf_getdata(scn, nullptr);
      if (d && d->d_buf && d->d_size >= 8) {
        const char* b = static_cast<const char*>(d->d_buf);
        size_t len = strnlen(b, d->d_size);
        size_t crc_off = (len + 4) & ~size_t{3};
        if (len > 0 && len < 4096 && crc_off + 4 <= d->d_size && !std::memchr(b, '/', len)) {
          DebugLink dl;
          dl.name.assign(b, len);
          uint32_t crc;
          std::memcpy(&crc, b + crc_off, 4);
          // Stored in the file's byte order.
          if ((eh.e_ident[EI_DATA] == ELFDATA2MSB) != (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__))
            crc = __builtin_bswap32(crc);
          dl.crc = crc;
          if (dl.name != "." && dl.name != "..") debuglink_ = std::move(dl);
        }
      }
    }
  }
  return {};
}

std::string_view Image::gnu_debugdata() const {
  if (!gnu_debugdata_) return {};
  Elf_Data* d = elf_rawdata(gnu_debugdata_, nullptr);
  if (!d || !d->d_buf) return {};
  return {static_cast<const char*>(d->d_buf), d->d_size};
}

// DT_RUNPATH, else DT_RPATH: strings in DT_STRTAB (an address: found in
// the PT_LOAD that holds it in the file).
void Image::read_search_path(uint64_t off, uint64_t size) {
  Elf_Data* d = elf_getdata_rawchunk(elf_, static_cast<int64_t>(off), size, ELF_T_DYN);
  size_t ent = gelf_fsize(elf_, ELF_T_DYN, 1, EV_CURRENT);
  if (!d || !ent) return;
  uint64_t strtab = 0, strsz = 0, runpath = 0, rpath = 0;
  bool have_runpath = false, have_rpath = false;
  for (size_t i = 0; i < d->d_size / ent; i++) {
    GElf_Dyn dyn;
    if (!gelf_getdyn(d, static_cast<int>(i), &dyn) || dyn.d_tag == DT_NULL) break;
    if (dyn.d_tag == DT_STRTAB) strtab = dyn.d_un.d_ptr;
    else if (dyn.d_tag == DT_STRSZ) strsz = dyn.d_un.d_val;
    else if (dyn.d_tag == DT_RUNPATH) have_runpath = true, runpath = dyn.d_un.d_val;
    else if (dyn.d_tag == DT_RPATH) have_rpath = true, rpath = dyn.d_un.d_val;
  }
  if (!have_runpath && !have_rpath) return;
  uint64_t at = have_runpath ? runpath : rpath;
  if (at >= strsz) return;
  for (const auto& s : segments_) {
    if (strtab < s.vaddr || strtab - s.vaddr >= s.filesz) continue;
    uint64_t in = strtab - s.vaddr;
    if (at >= s.filesz - in) return;
    std::string_view str = bytes(s.offset + in + at, std::min<uint64_t>(strsz - at, s.filesz - in - at));
    search_path_.assign(str.substr(0, str.find('\0')));
    return;
  }
}

std::optional<uint64_t> Image::offset_to_vaddr(uint64_t off) const {
  // Exactly inside a segment's file image, preferring executable segments
  // (old layouts let a data segment share file pages with the text).
  const Segment* best = nullptr;
  for (const auto& s : segments_) {
    if (off >= s.offset && off - s.offset < s.filesz) {
      if (!best || ((s.flags & PF_X) && !(best->flags & PF_X))) best = &s;
    }
  }
  if (!best) {
    // The page-aligned head a mapping starts with.
    for (const auto& s : segments_) {
      uint64_t lo = s.offset - (s.offset % kPage);
      if (off >= lo && off < s.offset) {
        best = &s;
        break;
      }
    }
  }
  if (!best) return std::nullopt;
  return off - best->offset + best->vaddr;
}

uint64_t Image::exec_end(uint64_t vaddr) const {
  for (const auto& [lo, hi] : code_sections_)
    if (vaddr >= lo && vaddr < hi) return hi;
  for (const auto& s : segments_)
    if (vaddr >= s.vaddr && vaddr - s.vaddr < s.memsz) return s.vaddr + s.memsz;
  return UINT64_MAX;
}

std::string_view Image::bytes(uint64_t offset, uint64_t len) const {
  size_t size = 0;
  const char* raw = elf_rawfile(elf_, &size);
  if (!raw) return {};
  size = std::min<uint64_t>(size, file_size_);
  if (offset >= size) return {};
  return {raw + offset, static_cast<size_t>(std::min<uint64_t>(len, size - offset))};
}

void Image::for_each_symbol(bool symtab, bool dynsym, const std::function<void(const SymbolRecord&)>& fn) const {
  size_t nsec = 0;
  if (elf_getshdrnum(elf_, &nsec) != 0) return;
  size_t ent = gelf_fsize(elf_, ELF_T_SYM, 1, EV_CURRENT);
  if (ent == 0) return;
  Elf_Scn* scn = nullptr;
  for (size_t n = 0; n < nsec && (scn = elf_nextscn(elf_, scn)) != nullptr; ++n) {
    GElf_Shdr sh;
    if (!gelf_getshdr(scn, &sh)) continue;
    bool is_dyn = sh.sh_type == SHT_DYNSYM;
    if (!((sh.sh_type == SHT_SYMTAB && symtab) || (is_dyn && dynsym))) continue;
    Elf_Data* d = elf_getdata(scn, nullptr);
    if (!d || !d->d_buf) continue;
    size_t count = d->d_size / ent;
    for (size_t i = 1; i < count; ++i) {
      GElf_Sym sym;
      if (!gelf_getsym(d, static_cast<int>(i), &sym)) break;
      SymbolRecord r;
      if (sym.st_name != 0)
        if (const char* name = elf_strptr(elf_, sh.sh_link, sym.st_name)) r.name = name;
      r.value = sym.st_value;
      r.size = sym.st_size;
      r.shndx = sym.st_shndx;
      r.type = GELF_ST_TYPE(sym.st_info);
      r.bind = GELF_ST_BIND(sym.st_info);
      r.dynamic = is_dyn;
      fn(r);
    }
  }
}

bool Image::compressed_sections_sane() const {
  size_t nsec = 0;
  if (elf_getshdrnum(elf_, &nsec) != 0) return true;
  size_t shstrndx = 0;
  bool have_names = elf_getshdrstrndx(elf_, &shstrndx) == 0;
  Elf_Scn* scn = nullptr;
  for (size_t n = 0; n < nsec && (scn = elf_nextscn(elf_, scn)) != nullptr; ++n) {
    GElf_Shdr sh;
    if (!gelf_getshdr(scn, &sh) || sh.sh_type == SHT_NOBITS) continue;
    uint64_t claimed = 0;
    if (sh.sh_flags & SHF_COMPRESSED) {
      GElf_Chdr ch;
      if (!gelf_getchdr(scn, &ch)) return false;
      claimed = ch.ch_size;
    } else {
      const char* name = have_names ? elf_strptr(elf_, shstrndx, sh.sh_name) : nullptr;
      if (!name || std::strncmp(name, ".zdebug", 7) != 0) continue;
      Elf_Data* d = elf_rawdata(scn, nullptr);
      if (!d || !d->d_buf || d->d_size < 12) return false;
      const unsigned char* b = static_cast<const unsigned char*>(d->d_buf);
      if (std::memcmp(b, "ZLIB", 4) != 0) return false;
      for (int i = 0; i < 8; ++i) claimed = (claimed << 8) | b[4 + i];
    }
    if (claimed > kMaxDecompressed || claimed > sh.sh_size * kMaxRatio + 4096) return false;
  }
  return true;
}

}  // namespace memtrace::elf
