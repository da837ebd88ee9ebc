#include "symbolize/minidebuginfo.h"

#include <lzma.h>

#include <string>

namespace memtrace::symbolize {
namespace {

// A symbol table of a large program (libLLVM: ~60 MB of .symtab) fits; a
// decompression bomb stops here.
constexpr size_t kMaxOutput = 256u << 20;
constexpr uint64_t kMemLimit = 128u << 20;  // decoder dictionary memory

struct Stream {
  lzma_stream s = LZMA_STREAM_INIT;
  ~Stream() { lzma_end(&s); }
};

}  // namespace

Result<std::unique_ptr<elf::Image>> open_minidebuginfo(const elf::Image& img) {
  std::string_view in = img.gnu_debugdata();
  if (in.empty()) return std::unique_ptr<elf::Image>();
  const std::string what = img.path() + ": .gnu_debugdata";
  Stream st;
  if (lzma_stream_decoder(&st.s, kMemLimit, 0) != LZMA_OK) return Error::msg(what + ": cannot start the xz decoder");
  st.s.next_in = reinterpret_cast<const uint8_t*>(in.data());
  st.s.avail_in = in.size();
  std::string out(std::min(kMaxOutput, in.size() * 4 + 4096), '\0');
  for (;;) {
    if (st.s.total_out == out.size()) {
      if (out.size() >= kMaxOutput) return Error::msg(what + ": decompresses to more than 256 MiB");
      out.resize(std::min(kMaxOutput, out.size() * 2));
    }
    st.s.next_out = reinterpret_cast<uint8_t*>(out.data()) + st.s.total_out;
    st.s.avail_out = out.size() - st.s.total_out;
    lzma_ret r = lzma_code(&st.s, LZMA_FINISH);
    if (r == LZMA_STREAM_END) break;
    if (r == LZMA_OK) continue;
    const char* why = r == LZMA_FORMAT_ERROR ? "not xz data"
                      : r == LZMA_DATA_ERROR ? "corrupt xz data"
                      : r == LZMA_BUF_ERROR  ? "truncated xz data"
                      : r == LZMA_MEMLIMIT_ERROR ? "xz dictionary larger than 128 MiB"
                                                 : "xz decoder error";
    return Error::msg(what + ": " + why);
  }
  out.resize(st.s.total_out);
  auto mini = elf::Image::from_memory(std::move(out), img.path() + " [.gnu_debugdata]");
  if (!mini) return Error::msg(what + ": " + mini.error().message);
  return std::move(mini).value();
}

}  // namespace memtrace::symbolize
