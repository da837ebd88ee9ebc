#include "loader/recording.h"

#include <sys/stat.h>

#include <cinttypes>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>

#include "elf/elf_file.h"
#include "loader/procfs.h"
#include "memtrace.h"
#include "symbolize/proc_maps.h"

namespace memtrace::loader {

uint32_t fnv1a(const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= 16777619u;
  }
  return h;
}

std::string build_id_of(const std::string& path) {
  static std::map<std::tuple<std::string, uint64_t, uint64_t, int64_t>, std::string> cache;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return "";
  auto key = std::make_tuple(path, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                             static_cast<int64_t>(st.st_mtim.tv_sec));
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::string id;
  if (auto f = elf::ElfFile::open(path)) id = f->build_id();
  cache[key] = id;
  return id;
}

namespace {
void put32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
}  // namespace

Result<std::unique_ptr<Recorder>> Recorder::open(const std::string& path, const nlohmann::json& meta) {
  auto r = std::unique_ptr<Recorder>(new Recorder());
  r->buf_.resize(1 << 20);
  r->f_.rdbuf()->pubsetbuf(r->buf_.data(), r->buf_.size());
  r->f_.open(path, std::ios::binary | std::ios::trunc);
  if (!r->f_) return Error::sys("cannot write recording " + path);
  r->path_ = path;
  std::string h;
  for (uint32_t v : {uint32_t(sizeof(mt_hdr)), uint32_t(sizeof(mt_event)), uint32_t(sizeof(mt_stack)),
                     uint32_t(sizeof(mt_proc_event)), uint32_t(MT_MAX_FRAMES), uint32_t(MT_COMM_LEN)})
    put32(h, v);
  std::string js = meta.dump();
  put32(h, js.size());
  h += js;
  std::string head(kRecMagic, 8);
  put32(head, kRecVersion);
  put32(head, h.size());
  head += h;
  r->f_.write(head.data(), head.size());
  if (!r->f_) return Error::sys("cannot write recording " + path);
  return r;
}

void Recorder::write(RecType t, const void* data, size_t len) {
  uint32_t h[3] = {t, static_cast<uint32_t>(len), fnv1a(data, len)};
  f_.write(reinterpret_cast<const char*>(h), sizeof h);
  f_.write(static_cast<const char*>(data), len);
  records_++;
  if (!f_ && error_.empty()) error_ = "writing recording " + path_ + ": " + strerror(errno);
}

void Recorder::write_json(RecType t, const nlohmann::json& j) {
  std::string s = j.dump();
  write(t, s.data(), s.size());
}

void Recorder::capture_maps(pid_t pid) {
  auto maps = symbolize::read_maps(pid);
  if (!maps) return;  // gone: what was captured before stays
  auto& seen = seen_[pid];
  nlohmann::json arr = nlohmann::json::array();
  for (const auto& m : *maps) {
    if (m.perms.find('x') == std::string::npos) continue;
    if (!seen.insert({m.start, m.end, m.offset, m.path}).second) continue;
    std::string bid;
    if (!m.path.empty() && m.path[0] == '/') {
      char range[96];
      snprintf(range, sizeof range, "/proc/%d/map_files/%" PRIx64 "-%" PRIx64, pid, m.start, m.end);
      bid = build_id_of(range);
    }
    arr.push_back({{"start", m.start},
                   {"end", m.end},
                   {"offset", m.offset},
                   {"dev", m.dev},
                   {"inode", m.inode},
                   {"perms", m.perms},
                   {"path", m.path},
                   {"build_id", bid}});
  }
  if (arr.empty()) return;
  nlohmann::json j = {{"pid", pid}, {"maps", std::move(arr)}};
  if (auto c = read_comm(pid)) j["comm"] = *c;
  write_json(REC_MAPS, j);
}

void Recorder::close() {
  if (!f_.is_open()) return;
  f_.flush();
  if (!f_ && error_.empty()) error_ = "writing recording " + path_ + ": " + strerror(errno);
  f_.close();
}

RecordedFile read_recording(const std::string& path, const std::function<void(const nlohmann::json&)>& on_meta,
                            const std::function<void(RecType, const std::vector<char>&)>& fn) {
  RecordedFile rf;
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    rf.error = "cannot open " + path + ": " + strerror(errno);
    return rf;
  }
  char magic[8];
  uint32_t hv[2];
  if (!f.read(magic, 8)) {
    rf.error = path + ": truncated header (" + std::to_string(f.gcount()) + " bytes; not a complete recording)";
    return rf;
  }
  if (memcmp(magic, kRecMagic, 8) != 0) {
    rf.error = path + " is not a memtrace-bpf recording (bad magic)";
    return rf;
  }
  if (!f.read(reinterpret_cast<char*>(hv), sizeof hv)) {
    rf.error = path + ": truncated header";
    return rf;
  }
  if (hv[0] != kRecVersion) {
    rf.error = path + ": recording format version " + std::to_string(hv[0]) + ", this build reads " +
               std::to_string(kRecVersion);
    return rf;
  }
  if (hv[1] < 28 || hv[1] > kRecMaxPayload) {
    rf.error = path + ": corrupt header (length " + std::to_string(hv[1]) + ")";
    return rf;
  }
  std::vector<char> h(hv[1]);
  if (!f.read(h.data(), h.size())) {
    rf.error = path + ": truncated header";
    return rf;
  }
  uint32_t sz[7];
  memcpy(sz, h.data(), sizeof sz);
  const uint32_t want[6] = {uint32_t(sizeof(mt_hdr)), uint32_t(sizeof(mt_event)), uint32_t(sizeof(mt_stack)),
                            uint32_t(sizeof(mt_proc_event)), uint32_t(MT_MAX_FRAMES), uint32_t(MT_COMM_LEN)};
  if (memcmp(sz, want, sizeof want) != 0) {
    char b[256];
    snprintf(b, sizeof b,
             "%s: record layouts differ from this build (hdr/event/stack/proc/frames/comm %u/%u/%u/%u/%u/%u, "
             "here %u/%u/%u/%u/%u/%u)",
             path.c_str(), sz[0], sz[1], sz[2], sz[3], sz[4], sz[5], want[0], want[1], want[2], want[3], want[4],
             want[5]);
    rf.error = b;
    return rf;
  }
  if (28 + static_cast<uint64_t>(sz[6]) > h.size()) {
    rf.error = path + ": corrupt header (metadata length)";
    return rf;
  }
  rf.meta = nlohmann::json::parse(std::string(h.data() + 28, sz[6]), nullptr, false);
  if (rf.meta.is_discarded()) {
    rf.error = path + ": corrupt header (metadata)";
    return rf;
  }
  on_meta(rf.meta);
  bool ended = false;
  std::vector<char> payload;
  for (;;) {
    uint64_t at = f.tellg();
    uint32_t rh[3];
    f.read(reinterpret_cast<char*>(rh), sizeof rh);
    if (f.gcount() == 0) break;  // clean end of file
    if (f.gcount() != sizeof rh) {
      rf.error = "truncated record header at offset " + std::to_string(at);
      break;
    }
    if (rh[0] < REC_EVENT || rh[0] > REC_END || rh[1] > kRecMaxPayload) {
      rf.error = "corrupt record at offset " + std::to_string(at) + " (type " + std::to_string(rh[0]) +
                 ", length " + std::to_string(rh[1]) + ")";
      break;
    }
    payload.resize(rh[1]);
    if (!f.read(payload.data(), rh[1])) {
      rf.error = "truncated record at offset " + std::to_string(at);
      break;
    }
    if (fnv1a(payload.data(), payload.size()) != rh[2]) {
      rf.error = "corrupt record at offset " + std::to_string(at) + " (checksum mismatch)";
      break;
    }
    rf.records++;
    if (rh[0] == REC_END) ended = true;
    fn(static_cast<RecType>(rh[0]), payload);
    if (ended) break;
  }
  if (rf.error.empty() && !ended) rf.error = "truncated: no end record (the tracer did not finish writing)";
  return rf;
}

}  // namespace memtrace::loader
