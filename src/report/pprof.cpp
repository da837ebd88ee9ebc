#include "report/pprof.h"
#include "procfs/cgroup.h"

#include <zlib.h>

#include <algorithm>
#include <map>
#include <unordered_map>

namespace memtrace::report {
namespace {

// Protocol buffers' wire format, what profile.proto needs of it: varints
// (wire type 0) and length-delimited fields (wire type 2).
class Pb {
 public:
  void varint(uint64_t v) {
    while (v >= 0x80) {
      b_ += static_cast<char>((v & 0x7f) | 0x80);
      v >>= 7;
    }
    b_ += static_cast<char>(v);
  }
  void tag(int field, int wire) { varint(static_cast<uint64_t>(field) << 3 | wire); }
  // Default values are left out, as protobuf does.
  void u64(int field, uint64_t v) {
    if (!v) return;
    tag(field, 0);
    varint(v);
  }
  void i64(int field, int64_t v) { u64(field, static_cast<uint64_t>(v)); }
  void flag(int field, bool v) { u64(field, v ? 1 : 0); }
  void bytes(int field, const std::string& s) {
    tag(field, 2);
    varint(s.size());
    b_ += s;
  }
  void msg(int field, const Pb& m) { bytes(field, m.b_); }
  void packed(int field, const std::vector<uint64_t>& v) {
    if (v.empty()) return;
    Pb p;
    for (uint64_t x : v) p.varint(x);
    bytes(field, p.b_);
  }
  const std::string& str() const { return b_; }

 private:
  std::string b_;
};

class Strings {
 public:
  Strings() { id(""); }  // string_table[0] is ""
  int64_t id(const std::string& s) {
    auto [it, added] = ids_.try_emplace(s, static_cast<int64_t>(table_.size()));
    if (added) table_.push_back(s);
    return it->second;
  }
  const std::vector<std::string>& table() const { return table_; }

 private:
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> table_;
};

// profile.proto field numbers.
enum ProfileField {
  kSampleType = 1, kSample = 2, kMapping = 3, kLocation = 4, kFunction = 5, kStringTable = 6,
  kTimeNanos = 9, kDurationNanos = 10, kPeriodType = 11, kPeriod = 12, kComment = 13, kDefaultSampleType = 14,
};

struct PidAddrHash {
  size_t operator()(const std::pair<pid_t, uint64_t>& k) const {
    return std::hash<uint64_t>()(k.second * 0x9e3779b97f4a7c15ull ^ static_cast<uint32_t>(k.first));
  }
};

struct MappingAcc {
  uint64_t id = 0;
  uint64_t lo = UINT64_MAX, hi = 0, lo_offset = 0;  // lowest looked-up address and its file offset
  std::string module;
  bool all_named = true;
};

}  // namespace

std::string pprof_profile(const heap::HeapModel& m, const Resolver& r, const Options& o, const PprofOptions& po) {
  Strings st;
  Pb prof;
  auto value_type = [&](int field, const char* type, const char* unit) {
    Pb vt;
    vt.i64(1, st.id(type));
    vt.i64(2, st.id(unit));
    prof.msg(field, vt);
  };
  value_type(kSampleType, "alloc_objects", "count");
  value_type(kSampleType, "alloc_space", "bytes");
  value_type(kSampleType, "inuse_objects", "count");
  value_type(kSampleType, "inuse_space", "bytes");

  std::map<std::pair<pid_t, std::string>, MappingAcc> mappings;        // by process and module
  std::map<std::pair<std::string, std::string>, uint64_t> functions;  // (name, file) -> id
  std::unordered_map<std::pair<pid_t, uint64_t>, uint64_t, PidAddrHash> locations;  // (pid, address) -> id
  Pb locs, funcs;
  uint64_t next_mapping = 1;

  auto function_id = [&](const std::string& name, const std::string& file) {
    auto [it, added] = functions.try_emplace({name, file}, functions.size() + 1);
    if (added) {
      Pb f;
      f.u64(1, it->second);
      f.i64(2, st.id(name));
      f.i64(3, st.id(name));
      f.i64(4, st.id(file));
      funcs.msg(kFunction, f);
    }
    return it->second;
  };
  // One location per address of a process: its frames (inlined ones first)
  // are its lines.
  auto location_id = [&](pid_t pid, uint64_t addr, const std::vector<FrameOut>& fs) {
    auto [it, added] = locations.try_emplace({pid, addr}, locations.size() + 1);
    if (!added) return it->second;
    Pb l;
    l.u64(1, it->second);
    const FrameOut& f0 = fs.front();
    if (!f0.module.empty()) {
      auto& ma = mappings[{pid, f0.module}];
      if (!ma.id) {
        ma.id = next_mapping++;
        ma.module = f0.module;
      }
      // Every address is a return address: the byte looked up is the call's, before it.
      uint64_t looked_up = addr - 1;
      if (looked_up < ma.lo) {
        ma.lo = looked_up;
        ma.lo_offset = f0.module_offset;
      }
      ma.hi = std::max(ma.hi, addr + 1);
      if (f0.function.empty()) ma.all_named = false;
      l.u64(2, ma.id);
    }
    l.u64(3, addr);
    for (const auto& f : fs) {
      if (f.function.empty()) continue;
      Pb line;
      line.u64(1, function_id(f.function, f.file));
      line.i64(2, f.line);
      l.msg(4, line);
    }
    locs.msg(kLocation, l);
    return it->second;
  };

  uint64_t no_stack_loc = 0;
  std::vector<const heap::Process*> images = po.only ? std::vector<const heap::Process*>{po.only} : m.images();
  for (const heap::Process* pp : images) {
    const heap::Process& p = *pp;
    if (!o.include_idle && !active(p)) continue;
    std::vector<std::pair<std::string, std::string>> process_labels;
    if (!p.cgroup.empty()) process_labels.emplace_back("cgroup", p.cgroup);
    procfs::Container ct = procfs::container_of(p.cgroup);
    if (!ct.id.empty()) process_labels.emplace_back("container_id", ct.id);
    if (!ct.pod.empty()) process_labels.emplace_back("pod_uid", ct.pod);
    for (auto c : stack_counts(p)) {
      if (po.alloc_base)
        if (auto b = po.alloc_base->find(c.stack_id); b != po.alloc_base->end()) {
          if (c.alloc_count >= b->second.first && c.alloc_bytes >= b->second.second) {
            c.alloc_count -= b->second.first;
            c.alloc_bytes -= b->second.second;
          }
        }
      if (!c.live_bytes && !c.live_blocks && !c.alloc_bytes && !c.alloc_count) continue;
      std::vector<uint64_t> loc_ids;
      const heap::Stack* s = c.stack_id ? m.stack(c.stack_id) : nullptr;
      std::vector<uint64_t> addrs;
      std::vector<std::vector<FrameOut>> each;
      if (s)
        for_each_frame(p, *s, [&](uint64_t addr, const heap::Loc* loc) {
          addrs.push_back(addr);
          each.push_back(r(p, addr, loc, true));
        });
      // Cut before a raw stack's first later frame that is no return address (frames_of).
      for (size_t i = 0, keep = trusted_addresses(each); i < keep; i++) {
        // An address seen before is its location: symbolized once per profile.
        if (auto known = locations.find({p.pid, addrs[i]}); known != locations.end())
          loc_ids.push_back(known->second);
        else if (!each[i].empty())
          loc_ids.push_back(location_id(p.pid, addrs[i], each[i]));
      }
      if (loc_ids.empty()) {
        if (!no_stack_loc) {
          no_stack_loc = locations.size() + 1;
          locations[{0, 0}] = no_stack_loc;
          Pb l, line;
          l.u64(1, no_stack_loc);
          line.u64(1, function_id("[no stack]", ""));
          l.msg(4, line);
          locs.msg(kLocation, l);
        }
        loc_ids.push_back(no_stack_loc);
      }
      Pb sm;
      sm.packed(1, loc_ids);
      sm.packed(2, {c.alloc_count, c.alloc_bytes, c.live_blocks, c.live_bytes});
      Pb pid_label, comm_label;
      pid_label.i64(1, st.id("pid"));
      pid_label.i64(3, p.pid);
      sm.msg(3, pid_label);
      comm_label.i64(1, st.id("comm"));
      comm_label.i64(2, st.id(p.comm));
      sm.msg(3, comm_label);
      for (const auto& [key, value] : process_labels) {  // its cgroup and container (issue 34)
        Pb l;
        l.i64(1, st.id(key));
        l.i64(2, st.id(value));
        sm.msg(3, l);
      }
      if (p.s.python.allocs) {  // two allocator domains in this process (issue 32)
        Pb alloc_label;
        alloc_label.i64(1, st.id("allocator"));
        alloc_label.i64(2, st.id(c.python ? "python" : "malloc"));
        sm.msg(3, alloc_label);
      }
      prof.msg(kSample, sm);
    }
  }
  // Mappings, in id order.
  std::vector<const MappingAcc*> ms;
  for (const auto& [k, ma] : mappings) ms.push_back(&ma);
  std::sort(ms.begin(), ms.end(), [](auto* a, auto* b) { return a->id < b->id; });
  for (const MappingAcc* ma : ms) {
    Pb mp;
    mp.u64(1, ma->id);
    mp.u64(2, ma->lo);
    mp.u64(3, ma->hi);
    mp.u64(4, ma->lo_offset);
    mp.i64(5, st.id(ma->module));
    if (po.build_id) mp.i64(6, st.id(po.build_id(ma->module)));
    mp.flag(7, ma->all_named);
    mp.flag(8, ma->all_named);
    mp.flag(9, ma->all_named);
    mp.flag(10, ma->all_named);
    prof.msg(kMapping, mp);
  }
  Pb period;
  period.i64(1, st.id("space"));
  period.i64(2, st.id("bytes"));
  int64_t default_type = st.id("inuse_space");
  // --sample-bytes: the rate as Go's heap profiles give theirs (period: the
  // mean bytes between samples; the values are scaled already), and a
  // comment saying the figures are estimates.
  int64_t comment = m.sample_bytes()
                        ? st.id("memtrace-bpf: sampled, one allocation per " + std::to_string(m.sample_bytes()) +
                                " bytes on average; every value is an unbiased estimate")
                        : -1;
  for (const auto& str : st.table()) prof.bytes(kStringTable, str);  // every id is taken by now
  prof.i64(kTimeNanos, po.time_nanos);
  prof.i64(kDurationNanos, po.duration_nanos);
  // Fields may come in any order: locations and functions were encoded apart.
  std::string out = prof.str() + locs.str() + funcs.str();
  Pb tail;
  tail.msg(kPeriodType, period);
  tail.i64(kPeriod, m.sample_bytes() ? static_cast<int64_t>(m.sample_bytes()) : 1);
  if (comment >= 0) tail.i64(kComment, comment);
  tail.i64(kDefaultSampleType, default_type);
  return out + tail.str();
}

Result<std::string> gzip(const std::string& data) {
  z_stream z{};
  // windowBits 15 + 16: a gzip header and trailer, not zlib's. The fastest
  // level, as Go's runtime/pprof writes profiles (--pprof-dir writes them
  // on the drain thread: 3-4 times faster than the default level, ~20%
  // larger).
  if (deflateInit2(&z, Z_BEST_SPEED, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    return Error::msg("gzip: deflateInit2 failed");
  std::string out(deflateBound(&z, data.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  int rc = deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  if (rc != Z_STREAM_END) return Error::msg("gzip: deflate failed (" + std::to_string(rc) + ")");
  return out;
}

Result<void> write_pprof(std::ostream& os, const heap::HeapModel& m, const Resolver& r, const Options& o,
                         const PprofOptions& po) {
  auto z = gzip(pprof_profile(m, r, o, po));
  if (!z) return z.error();
  os.write(z->data(), static_cast<std::streamsize>(z->size()));
  if (!os) return Error::msg("write failed");
  return {};
}

}  // namespace memtrace::report
