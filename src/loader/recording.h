// The --record file format, its writer and its reader.
//
//   header:  "MTRACE\0\1" (8 bytes magic), u32 version, u32 header bytes that
//            follow (h), then h bytes: u32 sizeof(mt_hdr), sizeof(mt_event),
//            sizeof(mt_stack), sizeof(mt_proc_event), MT_MAX_FRAMES,
//            MT_COMM_LEN, u32 json length, JSON (mode, command, start time).
//   records: u32 type, u32 payload length, u32 FNV-1a of the payload, payload.
//     REC_EVENT  an events-ring record as BPF wrote it (mt_event, or mt_stack:
//                MT_STACK_BYTES(nr) bytes, its header and nr frames; files of
//                builds before issue 18's deeper stacks say 64 frames and hold
//                whole 552-byte stack records: read as well)
//     REC_PROC   a proc-events-ring record (mt_proc_event)
//     REC_MAPS   JSON {"pid", "comm", "cgroup", "maps": [{"start","end","offset","dev","inode",
//                "perms","path","build_id"}]}: executable mappings captured while
//                the process lived (only the ones new since the last capture)
//     REC_PERFMAP JSON {"pid", "text"}: bytes of the process's perf map
//                (/tmp/perf-PID.map, JIT code names), in order (a map larger
//                than a record comes in several), written before REC_END
//     REC_PYFRAME JSON {"id", "function", "file", "line"}: a Python frame (src/python)
//                that stack records (spliced before they are written) name as
//                heap::kPyFrameTag | id; written before the first stack using it
//     REC_END    JSON {"processes": [{"pid","ppid","comm","cgroup","exited","exit_status"}],
//                "dropped", "stats", "errors", "mono_ns"}: final state at the
//                end of tracing, the last record; its absence means the file is truncated.
// Little-endian, this machine's layouts: the header's sizes must match (but
// for an older build's fewer frames, fixed-size stack records).
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <istream>
#include <memory>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/result.h"
#include "procfs/proc_maps.h"
#include "report/outputs.h"

namespace memtrace::loader {

inline constexpr char kRecMagic[8] = {'M', 'T', 'R', 'A', 'C', 'E', 0, 1};
inline constexpr uint32_t kRecVersion = 1;
inline constexpr uint32_t kRecMaxPayload = 16u << 20;

enum RecType : uint32_t { REC_EVENT = 1, REC_PROC = 2, REC_MAPS = 3, REC_END = 4, REC_PERFMAP = 5, REC_PYFRAME = 6 };

uint32_t fnv1a(const void* data, size_t len);
// Hex build-id of the ELF file at path ("" if none or unreadable), cached by path+dev+inode.
std::string build_id_of(const std::string& path);

class Recorder {
 public:
  static Result<std::unique_ptr<Recorder>> open(const std::string& path, const nlohmann::json& meta);
  void write(RecType t, const void* data, size_t len);
  void write_json(RecType t, const nlohmann::json& j);
  // The executable mappings of pid not written yet (read from /proc now).
  void capture_maps(pid_t pid, const std::vector<procfs::Mapping>* maps = nullptr);
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

// ---- reading. Every length, type and size is checked against the file and
// the format before it is used: a hostile file gives an error naming the
// offset, never more than one record's payload (at most kRecMaxPayload) in
// memory, nothing outside the buffers read. The metadata and the JSON records
// must have the fields and types the writer writes (unknown extra fields are
// ignored).

// What reading found.
struct RecordedFile {
  nlohmann::json meta;        // the header's metadata; null if the header could not be read
  std::string error;          // "" if the file read cleanly to its end record; else one line naming the offset
  uint64_t error_offset = 0;  // where it went wrong: reading stopped there
  uint64_t records = 0;       // records read and handed to fn: every record before error_offset
  bool header_ok() const { return meta.is_object(); }
};

// One record, checked: REC_EVENT a whole mt_event (kinds MT_EV_ALLOC to
// MT_EV_FAULT) or an mt_stack of exactly its nr frames (nr <= the file's
// frame limit; an older file's whole fixed-size record); REC_PROC a whole
// mt_proc_event of a lifecycle kind; pids from 0 to INT32_MAX, a fork's child
// not its parent; REC_MAPS, REC_END JSON as described above.
struct Record {
  RecType type;
  uint64_t offset;                   // of the record's header in the file
  const std::vector<char>& payload;  // as written (8-byte aligned: cast to the ring-buffer structs)
  const nlohmann::json& json;        // REC_MAPS, REC_END: the payload parsed; null for the others
};

// Reads a recording from in (bytes from its current position on: a file, a
// pipe, memory) and calls on_meta with the header's metadata, then fn for
// each record in order. Stops at the first truncated or corrupt byte and says
// where and why in the result's error.
RecordedFile read_recording(std::istream& in, const std::function<void(const nlohmann::json&)>& on_meta,
                            const std::function<void(const Record&)>& fn);
// The same on the file at path.
RecordedFile read_recording(const std::string& path, const std::function<void(const nlohmann::json&)>& on_meta,
                            const std::function<void(const Record&)>& fn);

// ---- `memtrace-bpf replay` (replay.cpp)
struct ReplayOptions;  // loader/features.h

// replay's work on an open recording (o.file names it in messages): the
// report to out, and for a truncated or corrupt file one line to err naming
// the offset. Returns the exit code: 0 complete; 1 stopped at an error after
// the header (the report covers every record before it); 2 no readable header
// (no report). open_files false: no file is looked at for symbols (frames
// stay unsymbolized; the fuzzer's setting). The text or JSON report goes to
// out unless o.outputs names only profiles; more: the other -o files, open.
using MoreOutputs = std::vector<std::pair<report::OutputSpec, std::ostream*>>;
int replay_recording(std::istream& in, const ReplayOptions& o, std::ostream& out, std::ostream& err,
                     bool open_files = true, const MoreOutputs& more = {});

// A recording replayed into a heap model, symbolized as replay does: what
// replay reports and `diff` compares.
struct Replayed {
  heap::HeapModel& model;  // not const: replay looks processes up (HeapModel::find)
  report::Resolver resolve;
  const report::Drops& drops;
  const RecordedFile& file;               // records read; error: where reading stopped
  const nlohmann::json& meta;             // the header's
  const nlohmann::json& end;              // the end record (null if the recording has none)
  const std::vector<std::string>& notes;  // binaries changed or missing since the recording
  uint64_t last_ts;                       // of the last event
};
// Reads the recording into a heap model and returns use(it); 2 and one line
// to err when no header could be read (use is not called).
int replay_model(std::istream& in, const ReplayOptions& o, std::ostream& err, bool open_files,
                 const std::function<int(const Replayed&)>& use);

}  // namespace memtrace::loader
