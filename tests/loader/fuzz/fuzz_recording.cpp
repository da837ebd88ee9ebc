// libFuzzer target for the --record format: the input is a recording (seeded
// with real ones, tests/loader/fuzz/corpus), read and reported by the entry
// point `memtrace-bpf replay` uses (replay_recording: read_recording, the
// heap model, the text and JSON reports with --live), with no file looked at
// for symbols. Any crash, hang, leak, runaway allocation or undefined
// behaviour is a bug, and so is a broken promise of replay's:
//   exit 0: nothing on stderr;
//   exit 1: exactly one stderr line naming an offset, and a report;
//   exit 2: exactly one stderr line, no report;
//   the JSON report is valid JSON;
//   a seekable input (a file) and a pipe stop at the same offset, same exit;
//   nothing read is lost, nothing after the error is used: the JSON report
//   of a file stopped at offset N is the one of its first N bytes.
// Each input is read as it is, and again with every record's checksum made
// right (mutations inside payloads then reach the record checks, the heap
// model and the reports instead of stopping at "checksum mismatch").
//
// Found (issue 17): a checksummed MT_EV_FORK event whose child pid (addr,
// truncated to pid_t) is its own pid made HeapModel::on_fork read the parent
// after replacing it (heap-use-after-free); read_recording now refuses a fork
// into itself, pids above INT32_MAX, and every size or kind the tracer cannot
// write (corpus/regress-fork-into-itself.mtr).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>
#include <streambuf>
#include <string>

#include "loader/features.h"
#include "loader/recording.h"

using namespace memtrace::loader;

namespace {

// Bytes that cannot be seeked, as a pipe: the reader does not know the size.
class PipeBuf : public std::streambuf {
 public:
  PipeBuf(const char* p, size_t n) {
    char* b = const_cast<char*>(p);
    setg(b, b, b + n);
  }
};

// The input with each whole record's checksum recomputed.
std::string with_checksums(const char* p, size_t n) {
  std::string d(p, n);
  if (n < 16) return d;
  uint32_t hl;
  memcpy(&hl, d.data() + 12, 4);
  for (uint64_t o = 16 + uint64_t{hl}; o + 12 <= n;) {
    uint32_t len;
    memcpy(&len, d.data() + o + 4, 4);
    if (o + 12 + len > n) break;
    uint32_t h = fnv1a(d.data() + o + 12, len);
    memcpy(&d[o + 8], &h, 4);
    o += 12 + len;
  }
  return d;
}

[[noreturn]] void broken(const char* what, const std::string& detail) {
  fprintf(stderr, "fuzz_recording: %s\n%s\n", what, detail.substr(0, 2000).c_str());
  abort();
}

// The number after "offset " in the error line; -1 if none.
long long offset_in(const std::string& err) {
  size_t at = err.find("offset ");
  if (at == std::string::npos) return -1;
  return strtoll(err.c_str() + at + 7, nullptr, 10);
}

int run(std::istream& in, const std::string& format, std::string* err_out, std::string* rep_out = nullptr) {
  ReplayOptions o;
  o.file = "fuzz.mtr";
  o.format = format;
  o.live = true;
  o.live_max = 20;
  o.top = 5;
  o.dwarf = false;
  std::ostringstream out, err;
  int code = replay_recording(in, o, out, err, /*open_files=*/false);
  std::string e = err.str(), rep = out.str();
  size_t lines = 0;
  for (char c : e) lines += c == '\n';
  if (code == 0 && !e.empty()) broken("exit 0 with an error line", e);
  if (code != 0 && (lines != 1 || e.back() != '\n')) broken("not exactly one error line", e);
  if (code != 0 && offset_in(e) < 0) broken("the error names no offset", e);
  if (code == 2 && !rep.empty()) broken("exit 2 with a report", rep);
  if (code != 2 && rep.empty()) broken("no report", e);
  if (code < 0 || code > 2) broken("exit code", std::to_string(code));
  if (format == "json" && code != 2 && !nlohmann::json::accept(rep)) broken("the JSON report is not JSON", rep);
  *err_out = e;
  if (rep_out) *rep_out = rep;
  return code;
}

nlohmann::json without_replay_key(const std::string& rep) {
  auto j = nlohmann::json::parse(rep);
  j.erase("replay");
  return j;
}

// The input as a file (text report) and as a pipe (JSON report); a stop at
// offset N: the JSON report of the first N bytes.
void both(const std::string& d, bool swap) {
  std::string e1, e2, r1, r2;
  std::istringstream file(d);
  int c1 = run(file, swap ? "json" : "text", &e1, &r1);
  PipeBuf pb(d.data(), d.size());
  std::istream pipe(&pb);
  int c2 = run(pipe, swap ? "text" : "json", &e2, &r2);
  if (c1 != c2 || offset_in(e1) != offset_in(e2)) broken("a file and a pipe disagree", e1 + e2);
  if (c1 == 1) {
    long long off = offset_in(e1);
    if (off < 0 || static_cast<size_t>(off) > d.size()) broken("offset outside the file", e1);
    std::string e3, r3;
    std::istringstream prefix(d.substr(0, static_cast<size_t>(off)));
    int c3 = run(prefix, "json", &e3, &r3);
    if (c3 == 2) broken("the bytes before the error have no readable header", e1 + e3);
    if (without_replay_key(swap ? r1 : r2) != without_replay_key(r3))
      broken("the report differs from the one of the bytes before the error", e1 + e3);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  std::string raw(p, size);
  both(raw, false);
  std::string fixed = with_checksums(p, size);
  if (fixed != raw) both(fixed, true);
  return 0;
}
