#include "common/hex.h"
#include "report.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <tuple>

namespace memtrace::singlestep {
namespace {

struct IpKey {
  uint64_t ip, address;
  uint32_t size;
  Access access;
  bool operator<(const IpKey& o) const {
    return std::tie(ip, address, size, access) < std::tie(o.ip, o.address, o.size, o.access);
  }
};

// Per region byte: bit0 read, bit1 written.
std::vector<std::vector<uint8_t>> byte_maps(const Report& r) {
  std::vector<std::vector<uint8_t>> maps;
  for (const auto& reg : r.regions) maps.emplace_back(reg.len, 0);
  for (const auto& rec : r.records)
    for (size_t i = 0; i < r.regions.size(); i++) {
      const auto& reg = r.regions[i];
      uint64_t lo = std::max(rec.address, reg.addr), hi = std::min(rec.address + rec.size, reg.addr + reg.len);
      for (uint64_t a = lo; a < hi; a++) maps[i][a - reg.addr] |= static_cast<uint8_t>(rec.access);
    }
  return maps;
}

// "rrrr..ww" in runs: [{offset, length, state}]
struct Run {
  uint64_t offset, length;
  uint8_t state;
};
std::vector<Run> runs(const std::vector<uint8_t>& m) {
  std::vector<Run> out;
  for (uint64_t i = 0; i < m.size(); i++) {
    if (!out.empty() && out.back().state == m[i] && out.back().offset + out.back().length == i) out.back().length++;
    else out.push_back({i, 1, m[i]});
  }
  return out;
}
const char* state_name(uint8_t s) {
  switch (s) {
    case 0: return "untouched";
    case 1: return "read";
    case 2: return "written";
    default: return "read-written";
  }
}

}  // namespace

const char* access_name(Access a) {
  switch (a) {
    case Access::kRead: return "read";
    case Access::kWrite: return "write";
    default: return "read-write";
  }
}

void Report::write_json(std::ostream& out) const {
  using nlohmann::json;
  json j;
  j["mode"] = mode;
  j["regions"] = json::array();
  for (const auto& r : regions)
    j["regions"].push_back({{"address", hex(r.addr)}, {"length", r.len}, {"name", r.name}});
  json acc = json::array();
  for (const auto& r : records)
    acc.push_back({{"time_ns", r.time_ns}, {"tid", r.tid}, {"ip", hex(r.ip)}, {"function", r.function},
                   {"address", hex(r.address)}, {"size", r.size}, {"access", access_name(r.access)}});
  j["accesses"] = std::move(acc);
  j["dropped"] = dropped;
  j["stop_reason"] = stop_reason;
  if (exit_code >= 0) j["exit_code"] = exit_code;
  j["stats"] = {{"emulated", emulated}, {"single_stepped", stepped},
                {"same_page_unrecorded", unrecorded_same_page}, {"syscalls_redirected", syscalls_redirected},
                {"syscalls_unprotected", unprotected_syscalls}};
  if (rearm_ms > 0) {
    json pages = json::array();
    for (const auto& [pg, n] : page_accesses) pages.push_back({{"page", hex(pg)}, {"first_accesses", n}});
    j["rearm"] = {{"interval_ms", rearm_ms},
                  {"intervals", rearm_intervals},
                  {"first_accesses", page_first_accesses},
                  {"pages", std::move(pages)}};
  }
  // Summary: by ip, then byte map per region.
  std::map<IpKey, uint64_t> by_ip;
  std::map<uint64_t, std::pair<std::string, std::string>> names;
  for (const auto& r : records) {
    by_ip[{r.ip, r.address, r.size, r.access}]++;
    names.emplace(r.ip, std::make_pair(r.function, r.insn));
  }
  json s = json::array();
  for (const auto& [k, n] : by_ip)
    s.push_back({{"ip", hex(k.ip)}, {"function", names[k.ip].first}, {"instruction", names[k.ip].second},
                 {"address", hex(k.address)}, {"size", k.size}, {"access", access_name(k.access)}, {"count", n}});
  j["summary"]["by_ip"] = std::move(s);
  auto maps = byte_maps(*this);
  json bm = json::array();
  for (size_t i = 0; i < regions.size(); i++) {
    json rr = json::array();
    uint64_t counts[4] = {};
    for (uint8_t b : maps[i]) counts[b]++;
    for (const auto& run : runs(maps[i]))
      rr.push_back({{"offset", run.offset}, {"length", run.length}, {"state", state_name(run.state)}});
    bm.push_back({{"address", hex(regions[i].addr)}, {"length", regions[i].len}, {"bytes_untouched", counts[0]},
                  {"bytes_read_only", counts[1]}, {"bytes_written_only", counts[2]},
                  {"bytes_read_and_written", counts[3]}, {"runs", std::move(rr)}});
  }
  j["summary"]["byte_map"] = std::move(bm);
  if (!track_allocs_from.empty()) {
    json b = json::array();
    for (const auto& bl : blocks)
      b.push_back({{"address", hex(bl.addr)}, {"size", bl.size}, {"alloc_time_ns", bl.alloc_time_ns},
                   {"free_time_ns", bl.free_time_ns}, {"reads", bl.reads}, {"writes", bl.writes},
                   {"bytes_read", bl.bytes_read}, {"bytes_written", bl.bytes_written}});
    j["blocks"] = std::move(b);
    j["track_allocs_from"] = track_allocs_from;
  }
  out << j.dump(1) << "\n";
}

void Report::write_text(std::ostream& out) const {
  out << "# memtrace-singlestep (" << mode << ")";
  for (const auto& r : regions)
    out << "  region " << hex(r.addr) << "+" << r.len << (r.name.empty() ? "" : " (" + r.name + ")");
  out << "\n# time_ns tid ip function address size access\n";
  for (const auto& r : records) {
    out << r.time_ns << " " << r.tid << " " << hex(r.ip) << " " << (r.function.empty() ? "?" : r.function) << " "
        << hex(r.address) << " " << r.size << " " << access_name(r.access) << "\n";
  }
  out << "# " << records.size() << " accesses recorded, " << dropped << " dropped, stopped: " << stop_reason;
  if (exit_code >= 0) out << " (exit code " << exit_code << ")";
  out << "\n# emulated " << emulated << ", single-stepped " << stepped << ", same-page accesses outside regions "
      << unrecorded_same_page << ", syscalls redirected " << syscalls_redirected
      << ", other syscalls run with the pages opened " << unprotected_syscalls << "\n";
  if (rearm_ms > 0)
    out << "# rearm every " << rearm_ms << " ms: " << rearm_intervals << " intervals, " << page_first_accesses
        << " first accesses on " << page_accesses.size() << " pages\n";
  std::map<IpKey, uint64_t> by_ip;
  std::map<uint64_t, std::pair<std::string, std::string>> names;
  for (const auto& r : records) {
    by_ip[{r.ip, r.address, r.size, r.access}]++;
    names.emplace(r.ip, std::make_pair(r.function, r.insn));
  }
  out << "\n## accesses by instruction\n";
  for (const auto& [k, n] : by_ip)
    out << "  " << hex(k.ip) << " " << (names[k.ip].first.empty() ? "?" : names[k.ip].first) << " ["
        << names[k.ip].second << "] " << access_name(k.access) << " " << hex(k.address) << "+" << k.size << " x" << n
        << "\n";
  out << "\n## byte map (. untouched, r read, w written, x read and written)\n";
  auto maps = byte_maps(*this);
  for (size_t i = 0; i < regions.size(); i++) {
    out << "  " << hex(regions[i].addr) << "+" << regions[i].len << ":\n";
    for (uint64_t off = 0; off < maps[i].size(); off += 64) {
      char line[128];
      std::snprintf(line, sizeof line, "    +%-6llu ", static_cast<unsigned long long>(off));
      out << line;
      for (uint64_t k = off; k < std::min<uint64_t>(off + 64, maps[i].size()); k++) out << ".rwx"[maps[i][k]];
      out << "\n";
    }
  }
  if (!track_allocs_from.empty()) {
    out << "\n## blocks allocated from " << track_allocs_from << "\n";
    for (const auto& b : blocks)
      out << "  " << hex(b.addr) << "+" << b.size << " reads " << b.reads << " writes " << b.writes
          << " bytes_read " << b.bytes_read << " bytes_written " << b.bytes_written
          << (b.free_time_ns ? " freed" : " live") << "\n";
  }
}

}  // namespace memtrace::singlestep
