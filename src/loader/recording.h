// The --record file format, its writer and its reader.
//
//   header:  "MTRACE\0\1" (8 bytes magic), u32 version, u32 header bytes that
//            follow (h), then h bytes: u32 sizeof(mt_hdr), sizeof(mt_event),
//            sizeof(mt_stack), sizeof(mt_proc_event), MT_MAX_FRAMES,
//            MT_COMM_LEN, u32 json length, JSON (mode, command, start time).
//   records: u32 type, u32 payload length, u32 FNV-1a of the payload, payload.
//     REC_EVENT  an events-ring record as BPF wrote it (mt_event or mt_stack)
//     REC_PROC   a proc-events-ring record (mt_proc_event)
//     REC_MAPS   JSON {"pid", "comm", "maps": [{"start","end","offset","dev","inode",
//                "perms","path","build_id"}]}: executable mappings captured while
//                the process lived (only the ones new since the last capture)
//     REC_END    JSON {"processes": [{"pid","comm","exited","exit_status"}],
//                "dropped", "stats", "errors", "mono_ns"}: final state at the
//                end of tracing; its absence means the file is truncated.
// Little-endian, this machine's layouts: the header's sizes must match.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/result.h"

namespace memtrace::loader {

inline constexpr char kRecMagic[8] = {'M', 'T', 'R', 'A', 'C', 'E', 0, 1};
inline constexpr uint32_t kRecVersion = 1;
inline constexpr uint32_t kRecMaxPayload = 16u << 20;

enum RecType : uint32_t { REC_EVENT = 1, REC_PROC = 2, REC_MAPS = 3, REC_END = 4 };

uint32_t fnv1a(const void* data, size_t len);
// Hex build-id of the ELF file at path ("" if none or unreadable), cached by path+dev+inode.
std::string build_id_of(const std::string& path);

class Recorder {
 public:
  static Result<std::unique_ptr<Recorder>> open(const std::string& path, const nlohmann::json& meta);
  void write(RecType t, const void* data, size_t len);
  void write_json(RecType t, const nlohmann::json& j);
  // The executable mappings of pid not written yet (read from /proc now).
  void capture_maps(pid_t pid);
  void close();
  uint64_t records() const { return records_; }
  const std::string& error() const { return error_; }  // first write error, "" if none

 private:
  std::ofstream f_;
  std::string path_;
  std::vector<char> buf_;
  uint64_t records_ = 0;
  std::string error_;
  std::map<pid_t, std::set<std::tuple<uint64_t, uint64_t, uint64_t, std::string>>> seen_;
};

struct RecordedFile {
  nlohmann::json meta;
  std::string error;          // "" if the whole file read cleanly with an end record
  uint64_t records = 0;       // records read
};

// Reads path and calls fn for each record in order. Stops at the first
// corrupt or truncated record and says why in the result's error.
RecordedFile read_recording(const std::string& path, const std::function<void(const nlohmann::json&)>& on_meta,
                            const std::function<void(RecType, const std::vector<char>&)>& fn);

}  // namespace memtrace::loader
