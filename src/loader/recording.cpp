#include "loader/recording.h"

#include "loader/output_file.h"
#include "procfs/cgroup.h"
#include "report/report.h"

#include <sys/stat.h>

#include <cinttypes>
#include <climits>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>

#include "elf/image.h"
#include "loader/procfs.h"
#include "memtrace.h"
#include "procfs/proc_maps.h"

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
  if (auto img = elf::Image::open(path)) id = (*img)->build_id_hex();
  cache[key] = id;
  return id;
}

namespace {
void put32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
std::string dump(const nlohmann::json& j) { return report::json_text(j); }
}  // namespace

Result<std::unique_ptr<Recorder>> Recorder::open(const std::string& path, const nlohmann::json& meta) {
  auto r = std::unique_ptr<Recorder>(new Recorder());
  r->buf_.resize(1 << 20);
  r->f_.rdbuf()->pubsetbuf(r->buf_.data(), r->buf_.size());
  // Holds memory contents (--dump-bytes) and every stack: the owner's only.
  auto fd = create_output(path, Privacy::Private);
  if (!fd) return fd.error();
  r->f_.open(fd_path(*fd), std::ios::binary | std::ios::trunc);
  if (!r->f_) return Error::sys("cannot write recording " + path);
  r->path_ = path;
  std::string h;
  for (uint32_t v : {uint32_t(sizeof(mt_hdr)), uint32_t(sizeof(mt_event)), uint32_t(sizeof(mt_stack)),
                     uint32_t(sizeof(mt_proc_event)), uint32_t(MT_MAX_FRAMES), uint32_t(MT_COMM_LEN)})
    put32(h, v);
  std::string js = dump(meta);
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
  std::string s = dump(j);
  write(t, s.data(), s.size());
}

// maps: the caller's read of /proc/PID/maps (null: read here).
void Recorder::capture_maps(pid_t pid, const std::vector<procfs::Mapping>* given) {
  Result<std::vector<procfs::Mapping>> read = std::vector<procfs::Mapping>{};
  if (!given) {
    read = procfs::read_maps(pid);
    if (!read) return;  // gone: what was captured before stays
    given = &*read;
  }
  const auto* maps = given;
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
  if (auto cg = procfs::cgroup_of(pid)) j["cgroup"] = *cg;
  write_json(REC_MAPS, j);
}

void Recorder::close() {
  if (!f_.is_open()) return;
  f_.flush();
  if (!f_ && error_.empty()) error_ = "writing recording " + path_ + ": " + strerror(errno);
  f_.close();
}

// ------------------------------------------------------------------ reading

namespace {

using nlohmann::json;

// Reads in from its current position, counting the offset; at most size
// bytes in all when that is known (a regular file, memory: the file as it was
// when reading started).
class Source {
 public:
  explicit Source(std::istream& in) : in_(in) {
    auto start = in.tellg();
    if (start != std::istream::pos_type(-1) && in.seekg(0, std::ios::end)) {
      auto end = in.tellg();
      if (end != std::istream::pos_type(-1) && end >= start) size_ = static_cast<uint64_t>(end - start);
    }
    in.clear();
    if (start != std::istream::pos_type(-1)) in.seekg(start);
    in.clear();
  }
  // Bytes read (fewer than n at the end of the file).
  size_t read(void* buf, size_t n) {
    if (size_ && *size_ - pos_ < n) n = *size_ - pos_;
    if (n == 0) return 0;
    in_.read(static_cast<char*>(buf), static_cast<std::streamsize>(n));
    size_t got = static_cast<size_t>(in_.gcount());
    pos_ += got;
    return got;
  }
  uint64_t pos() const { return pos_; }
  bool failed() const { return in_.bad(); }  // a read error, not the end of the file
  std::optional<uint64_t> size() const { return size_; }
  // What is left after pos_, when the size is known.
  std::optional<uint64_t> left() const {
    if (!size_) return std::nullopt;
    return *size_ - pos_;
  }
  // The file's size for messages: known, or where reading ended.
  uint64_t size_or_end() const { return size_ ? *size_ : pos_; }

 private:
  std::istream& in_;
  uint64_t pos_ = 0;
  std::optional<uint64_t> size_;
};

std::string num(uint64_t v) { return std::to_string(v); }

// Field checks for the JSON parts: "" if fine, else what is wrong.
bool is_uint(const json& j, const char* k, uint64_t max = UINT64_MAX) {
  auto it = j.find(k);
  return it != j.end() && it->is_number_unsigned() && it->get<uint64_t>() <= max;
}
std::string need_uint(const json& j, const char* k, uint64_t max = UINT64_MAX) {
  if (is_uint(j, k, max)) return "";
  return std::string("\"") + k + "\" " + (j.contains(k) ? "is not an integer from 0 to " + num(max) : "is missing");
}
std::string may_uint(const json& j, const char* k, uint64_t max = UINT64_MAX) {
  return j.contains(k) ? need_uint(j, k, max) : "";
}
std::string need_string(const json& j, const char* k) {
  auto it = j.find(k);
  if (it != j.end() && it->is_string()) return "";
  return std::string("\"") + k + "\" " + (it != j.end() ? "is not a string" : "is missing");
}
std::string may_string(const json& j, const char* k) { return j.contains(k) ? need_string(j, k) : ""; }
std::string may_bool(const json& j, const char* k) {
  auto it = j.find(k);
  return it == j.end() || it->is_boolean() ? "" : std::string("\"") + k + "\" is not true or false";
}
std::string may_strings(const json& j, const char* k) {
  auto it = j.find(k);
  if (it == j.end()) return "";
  bool ok = it->is_array();
  if (ok)
    for (const auto& e : *it) ok = ok && e.is_string();
  return ok ? "" : std::string("\"") + k + "\" is not an array of strings";
}
std::string may_counters(const json& j, const char* k) {
  auto it = j.find(k);
  if (it == j.end()) return "";
  bool ok = it->is_object();
  if (ok)
    for (const auto& [name, v] : it->items()) ok = ok && v.is_number_unsigned();
  return ok ? "" : std::string("\"") + k + "\" is not an object of counters";
}
// The first non-empty message.
std::string first(std::initializer_list<std::string> msgs) {
  for (const auto& m : msgs)
    if (!m.empty()) return m;
  return "";
}

constexpr uint64_t kMaxPid = INT32_MAX;

std::string check_meta(const json& m) {
  if (!m.is_object()) return "not a JSON object";
  return first({may_bool(m, "system_wide"), may_bool(m, "include_idle"), may_strings(m, "command")});
}

std::string check_maps(const json& j) {
  if (!j.is_object()) return "not a JSON object";
  std::string e = first({need_uint(j, "pid", kMaxPid), may_string(j, "comm"), may_string(j, "cgroup")});
  if (!e.empty()) return e;
  auto it = j.find("maps");
  if (it == j.end() || !it->is_array()) return "\"maps\" is not an array";
  size_t i = 0;
  for (const auto& m : *it) {
    if (!m.is_object()) return "mapping " + num(i) + " is not an object";
    e = first({need_uint(m, "start"), need_uint(m, "end"), need_uint(m, "offset"), need_uint(m, "dev"),
               need_uint(m, "inode"), need_string(m, "perms"), need_string(m, "path"), need_string(m, "build_id")});
    if (e.empty() && m["start"].get<uint64_t>() >= m["end"].get<uint64_t>()) e = "start is not below end";
    if (!e.empty()) return "mapping " + num(i) + ": " + e;
    i++;
  }
  return "";
}

std::string check_perfmap(const json& j) {
  if (!j.is_object()) return "not a JSON object";
  return first({need_uint(j, "pid", kMaxPid), need_string(j, "text")});
}

std::string check_end(const json& j) {
  if (!j.is_object()) return "not a JSON object";
  auto it = j.find("processes");
  if (it == j.end() || !it->is_array()) return "\"processes\" is not an array";
  size_t i = 0;
  for (const auto& p : *it) {
    if (!p.is_object()) return "process " + num(i) + " is not an object";
    std::string e = first({need_uint(p, "pid", kMaxPid), may_uint(p, "ppid", kMaxPid), may_string(p, "comm"), may_string(p, "cgroup"),
                           may_bool(p, "exited")});
    auto st = p.find("exit_status");
    if (e.empty() && st != p.end() && !st->is_null() &&
        !(st->is_number_integer() && st->get<int64_t>() >= INT32_MIN && st->get<int64_t>() <= INT32_MAX))
      e = "\"exit_status\" is not an integer or null";
    if (!e.empty()) return "process " + num(i) + ": " + e;
    i++;
  }
  return first({may_counters(j, "dropped"), may_counters(j, "stats"), may_strings(j, "errors"),
                may_uint(j, "mono_ns")});
}

bool event_kind(uint32_t k) { return k >= MT_EV_ALLOC && k <= MT_EV_FAULT && k != MT_EV_STACK; }
bool proc_kind(uint32_t k) {
  return k == MT_EV_EXEC || k == MT_EV_FORK || k == MT_EV_EXIT || k == MT_EV_LIBMAP;
}

// The stack records of a file, as its header describes them: this build's
// (variable-size, MT_STACK_BYTES(nr)), or an older build's with a lower frame
// limit (64 before issue 18), whose stack records all had its fixed
// sizeof(mt_stack).
struct StackLayout {
  uint32_t frames = MT_MAX_FRAMES;  // the writer's MT_MAX_FRAMES
  uint32_t fixed_bytes = 0;         // the older writer's sizeof(mt_stack); 0: variable-size records
};

// What is wrong with a record whose checksum matched ("" if nothing); j: the
// parsed payload of a JSON record.
std::string check_record(uint32_t type, const std::vector<char>& p, json* j, const StackLayout& sl) {
  mt_hdr h{};
  if (p.size() >= sizeof h) memcpy(&h, p.data(), sizeof h);
  switch (type) {
    case REC_EVENT:
      if (p.size() >= MT_STACK_HDR_BYTES && h.kind == MT_EV_STACK) {
        uint32_t nr;
        memcpy(&nr, p.data() + offsetof(mt_stack, nr), sizeof nr);
        if (nr > sl.frames) return "stack record of " + num(nr) + " frames (at most " + num(sl.frames) + ")";
        if (sl.fixed_bytes ? p.size() != sl.fixed_bytes : p.size() != MT_STACK_BYTES(uint64_t{nr}))
          return "stack record of " + num(p.size()) + " bytes for " + num(nr) + " frames (" +
                 num(sl.fixed_bytes ? sl.fixed_bytes : MT_STACK_BYTES(uint64_t{nr})) + " bytes)";
        return "";
      }
      if (p.size() == sizeof(mt_event) && event_kind(h.kind)) {
        if (h.pid > kMaxPid) return "event record of pid " + num(h.pid);
        uint64_t child;
        memcpy(&child, p.data() + offsetof(mt_event, addr), sizeof child);
        // A fork's child is another process (the model forks one pid into another).
        if (h.kind == MT_EV_FORK && (child == 0 || child > kMaxPid || child == h.pid))
          return "fork record of pid " + num(h.pid) + " with child " + num(child);
        return "";
      }
      return "event record of " + num(p.size()) + " bytes" +
             (p.size() >= sizeof h ? ", kind " + num(h.kind) : std::string()) + " (an event is " +
             num(sizeof(mt_event)) + " bytes of kind " + num(MT_EV_ALLOC) + " to " + num(MT_EV_FAULT) +
             ", a stack " + num(MT_STACK_HDR_BYTES) + " + 8 per frame bytes of kind " + num(MT_EV_STACK) + ")";
    case REC_PROC:
      if (p.size() == sizeof(mt_proc_event) && proc_kind(h.kind)) {
        if (h.pid > kMaxPid) return "process record of pid " + num(h.pid);
        uint32_t ppid;
        memcpy(&ppid, p.data() + offsetof(mt_proc_event, ppid), sizeof ppid);
        if (h.kind == MT_EV_FORK && (ppid > kMaxPid || ppid == h.pid))
          return "fork record of pid " + num(h.pid) + " with parent " + num(ppid);
        return "";
      }
      return "process record of " + num(p.size()) + " bytes" +
             (p.size() >= sizeof h ? ", kind " + num(h.kind) : std::string()) + " (one is " +
             num(sizeof(mt_proc_event)) + " bytes of kind " + num(MT_EV_EXEC) + " to " + num(MT_EV_LIBMAP) + ")";
    case REC_PYFRAME: {
      *j = json::parse(p.begin(), p.end(), nullptr, false);
      if (j->is_discarded() || !j->is_object()) return "python frame record: not a JSON object";
      auto id = j->find("id"), fn = j->find("function"), file = j->find("file"), line = j->find("line");
      if (id == j->end() || !id->is_number_unsigned() || id->get<uint64_t>() == 0 || id->get<uint64_t>() > (1u << 24))
        return "python frame record: id not a number from 1 to 2^24";
      if (fn == j->end() || !fn->is_string() || file == j->end() || !file->is_string())
        return "python frame record: function or file not a string";
      if (line == j->end() || !line->is_number_integer()) return "python frame record: line not an integer";
      return "";
    }
    case REC_MAPS:
    case REC_PERFMAP:
    case REC_END: {
      const char* what = type == REC_MAPS ? "mappings record" : type == REC_PERFMAP ? "perf map record" : "end record";
      *j = json::parse(p.begin(), p.end(), nullptr, false);
      if (j->is_discarded()) return std::string(what) + ": not JSON";
      std::string e = type == REC_MAPS ? check_maps(*j) : type == REC_PERFMAP ? check_perfmap(*j) : check_end(*j);
      return e.empty() ? "" : std::string(what) + ": " + e;
    }
  }
  return "type " + num(type);
}

}  // namespace

RecordedFile read_recording(std::istream& in, const std::function<void(const nlohmann::json&)>& on_meta,
                            const std::function<void(const Record&)>& fn) {
  RecordedFile rf;
  Source src(in);
  auto fail = [&](uint64_t at, const std::string& what) {
    rf.error_offset = at;
    rf.error = src.failed() ? "read error at offset " + num(src.pos()) : what;
    return rf;
  };
  // Truncated inside the header: names where the file ends.
  auto short_header = [&](size_t header_bytes) {
    uint64_t end = src.pos();
    return fail(end, end == 0 ? "truncated header at offset 0: the file is empty"
                              : "truncated header at offset " + num(end) + ": the file ends there, inside the " +
                                    num(header_bytes) + "-byte header");
  };

  char magic[8];
  size_t got = src.read(magic, sizeof magic);
  if (memcmp(magic, kRecMagic, got) != 0)
    return fail(0, "not a memtrace-bpf recording (no recording magic at offset 0)");
  if (got < sizeof magic) return short_header(16);
  uint32_t hv[2];
  if (src.read(hv, sizeof hv) < sizeof hv) return short_header(16);
  if (hv[0] != kRecVersion)
    return fail(8, "recording format version " + num(hv[0]) + " at offset 8, this build reads version " +
                       num(kRecVersion));
  const uint64_t header_bytes = 16 + uint64_t{hv[1]};
  if (hv[1] < 28 || hv[1] > kRecMaxPayload)
    return fail(12, "corrupt header at offset 12: header length " + num(hv[1]) + " (28 to " + num(kRecMaxPayload) +
                        " bytes)");
  if (auto left = src.left(); left && *left < hv[1])
    return fail(src.size_or_end(), "truncated header at offset " + num(src.size_or_end()) +
                                       ": the file ends there, inside the " + num(header_bytes) + "-byte header");
  std::vector<char> h(hv[1]);
  if (src.read(h.data(), h.size()) < h.size()) return short_header(header_bytes);
  uint32_t sz[7];
  memcpy(sz, h.data(), sizeof sz);
  const uint32_t want[6] = {uint32_t(sizeof(mt_hdr)), uint32_t(sizeof(mt_event)), uint32_t(sizeof(mt_stack)),
                            uint32_t(sizeof(mt_proc_event)), uint32_t(MT_MAX_FRAMES), uint32_t(MT_COMM_LEN)};
  // An older build's recording: the same records but fixed-size stacks of
  // fewer frames (readable: every stack fits this build's).
  StackLayout sl;
  const bool older_stacks = sz[4] >= 1 && sz[4] < MT_MAX_FRAMES && sz[2] == MT_STACK_BYTES(uint64_t{sz[4]});
  // Builds before the Python frames' slots (issue 32): the same variable-size records.
  if (sz[4] == MT_MAX_FRAMES && sz[2] == MT_STACK_BYTES(uint64_t{MT_MAX_FRAMES})) sz[2] = want[2];
  if (older_stacks) sl = StackLayout{sz[4], sz[2]};
  if (sz[0] != want[0] || sz[1] != want[1] || sz[3] != want[3] || sz[5] != want[5] ||
      !((sz[2] == want[2] && sz[4] == want[4]) || older_stacks)) {
    char b[256];
    snprintf(b, sizeof b,
             "record layouts at offset 16 differ from this build's (hdr/event/stack/proc/frames/comm "
             "%u/%u/%u/%u/%u/%u, here %u/%u/%u/%u/%u/%u)",
             sz[0], sz[1], sz[2], sz[3], sz[4], sz[5], want[0], want[1], want[2], want[3], want[4], want[5]);
    return fail(16, b);
  }
  if (28 + uint64_t{sz[6]} > h.size())
    return fail(40, "corrupt header at offset 40: metadata length " + num(sz[6]) + " past the header's end (" +
                        num(header_bytes) + " bytes)");
  json meta = json::parse(h.begin() + 28, h.begin() + 28 + sz[6], nullptr, false);
  if (meta.is_discarded()) return fail(44, "corrupt header at offset 44: the metadata is not JSON");
  if (std::string e = check_meta(meta); !e.empty()) return fail(44, "corrupt header at offset 44: metadata: " + e);
  rf.meta = std::move(meta);
  on_meta(rf.meta);

  std::vector<char> payload;
  for (;;) {
    const uint64_t at = src.pos();
    uint32_t rh[3];
    got = src.read(rh, sizeof rh);
    if (got == 0)
      return fail(at, "truncated at offset " + num(at) +
                          ": the file ends there, without the end record (the tracer did not finish writing)");
    if (got < sizeof rh)
      return fail(at, "truncated record at offset " + num(at) + ": the file ends " + num(got) +
                          " bytes into the record's 12-byte header (" + num(src.size_or_end()) + " bytes)");
    const uint32_t type = rh[0], len = rh[1];
    if (type < REC_EVENT || type > REC_PYFRAME)
      return fail(at, "corrupt record at offset " + num(at) + ": type " + num(type) + " (records are of types " +
                          num(REC_EVENT) + " to " + num(REC_PYFRAME) + ")");
    if (auto left = src.left(); left && *left < len)
      return fail(at, std::string(len > kRecMaxPayload ? "corrupt" : "truncated") + " record at offset " + num(at) +
                          ": length " + num(len) + " past the end of the file (" + num(*src.size()) + " bytes)");
    if (len > kRecMaxPayload)
      return fail(at, "corrupt record at offset " + num(at) + ": length " + num(len) + " over the " +
                          num(kRecMaxPayload) + "-byte limit");
    payload.resize(len);
    if (src.read(payload.data(), len) < len)
      return fail(at, "truncated record at offset " + num(at) + ": length " + num(len) +
                          " past the end of the file (" + num(src.pos()) + " bytes)");
    if (fnv1a(payload.data(), payload.size()) != rh[2])
      return fail(at, "corrupt record at offset " + num(at) + ": checksum mismatch (type " + num(type) +
                          ", length " + num(len) + ")");
    json j;
    if (std::string e = check_record(type, payload, &j, sl); !e.empty())
      return fail(at, "corrupt record at offset " + num(at) + ": " + e);
    rf.records++;
    fn(Record{static_cast<RecType>(type), at, payload, j});
    if (type == REC_END) break;
  }
  // The end record is the last.
  const uint64_t end = src.pos();
  char c;
  if (src.read(&c, 1) == 1) {
    std::string more = src.size() ? num(*src.size() - end) + " bytes" : "data";
    return fail(end, "corrupt recording at offset " + num(end) + ": " + more + " after the end record");
  }
  if (src.failed()) return fail(end, "");
  return rf;
}

RecordedFile read_recording(const std::string& path, const std::function<void(const nlohmann::json&)>& on_meta,
                            const std::function<void(const Record&)>& fn) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    RecordedFile rf;
    rf.error = "cannot open " + path + ": " + strerror(errno);
    return rf;
  }
  return read_recording(f, on_meta, fn);
}

}  // namespace memtrace::loader
