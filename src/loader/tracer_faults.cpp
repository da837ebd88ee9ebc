// The Tracer's part of --rearm (issue 6): resolve the ranges, start and stop
// memtrace-singlestep in page mode. Kept apart from tracer.cpp's attach and
// drain loop.
#include <fcntl.h>
#include <unistd.h>

#include "common/fd.h"
#include "loader/tracer.h"

namespace memtrace::loader {
namespace {

// --range ADDR of a block allocated before tracing: glibc's chunk header
// (size field at ADDR-8; bit 1: mmapped chunk, whose header is 16 bytes).
Result<AddrRange> glibc_block(pid_t pid, const AddrRange& r) {
  std::string path = "/proc/" + std::to_string(pid) + "/mem";
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  uint64_t v = 0;
  if (!fd.valid() || r.start < 16 || (r.start & 15) ||
      pread(fd.get(), &v, sizeof v, static_cast<off_t>(r.start - 8)) != sizeof v)
    return Error::msg("--range " + r.spec + " is not mapped in process " + std::to_string(pid) +
                      " (and is no live block: give START-END)");
  uint64_t chunk = v & ~7ull;
  uint64_t usable = chunk - ((v & 2) ? 16 : 8);
  if (chunk < 32 || chunk > (1ull << 40))
    return Error::msg("--range " + r.spec + " is not a live block known to the tracer nor a glibc malloc chunk: "
                      "give START-END");
  AddrRange b = r;
  b.end = r.start + usable;
  return b;
}

}  // namespace

Result<void> Tracer::start_rearm() {
  if (o_.rearm_ms <= 0) return {};
  pid_t pid = o_.pids.at(0);
  std::vector<AddrRange> ranges;
  for (const auto& spec : o_.ranges) {
    auto r = parse_range(spec);
    if (!r) return r.error();
    if (r->end == 0) {
      // A live block: one the model saw allocated, else glibc's chunk header.
      if (auto* p = model_.find(pid)) {
        auto h = model_.attribute(*p, r->start);
        if (h.kind == heap::Hit::Block) r->start = h.start, r->end = h.end;
      }
      if (r->end == 0) {
        auto b = glibc_block(pid, *r);
        if (!b) return b.error();
        *r = *b;
      }
    }
    if (auto ok = check_mapped(pid, *r); !ok) return ok.error();
    ranges.push_back(*r);
  }
  rearm_ = std::make_unique<RearmHelper>();
  if (auto r = rearm_->start(pid, ranges, o_.rearm_ms); !r) return r;
  log("rearm: memtrace-singlestep armed " + std::to_string(ranges.size()) + " range(s)");
  return {};
}

void Tracer::stop_rearm() {
  if (!rearm_) return;
  rearm_report_ = rearm_->stop();
  rearm_.reset();
}

}  // namespace memtrace::loader
