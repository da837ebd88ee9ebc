#include "unwind/unwind_maps.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/fd.h"

namespace memtrace::unwind {

Result<std::vector<ProcMapping>> read_proc_maps(pid_t pid) {
  std::string p = "/proc/" + std::to_string(pid) + "/maps";
  std::ifstream in(p);
  if (!in) return Error::sys("open " + p);
  std::vector<ProcMapping> out;
  std::string line;
  while (std::getline(in, line)) {
    ProcMapping m;
    char perms[8] = {};
    char dev[32] = {};
    int path_at = 0;
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64 " %7s %" SCNx64 " %31s %" SCNu64 " %n",
                    &m.start, &m.end, perms, &m.offset, dev, &m.inode, &path_at) < 6)
      continue;
    m.perms = perms;
    if (path_at > 0 && static_cast<size_t>(path_at) <= line.size()) m.path = line.substr(path_at);
    out.push_back(std::move(m));
  }
  return out;
}

Result<std::unique_ptr<UnwindMaps>> UnwindMaps::create(const bpf_map* rows, const bpf_map* procs,
                                                       const bpf_map* epoch) {
  return create_fds(bpf_map__fd(rows), bpf_map__max_entries(rows), bpf_map__fd(procs),
                    epoch ? bpf_map__fd(epoch) : -1);
}

Result<std::unique_ptr<UnwindMaps>> UnwindMaps::create_fds(int rows_fd, uint32_t max_rows, int procs_fd,
                                                           int epoch_fd) {
  if (rows_fd < 0 || procs_fd < 0) return Error::msg("unwind maps: BPF maps not created (skeleton not loaded?)");
  std::unique_ptr<UnwindMaps> m(new UnwindMaps());
  m->rows_fd_ = rows_fd;
  m->procs_fd_ = procs_fd;
  m->epoch_fd_ = epoch_fd;
  m->max_rows_ = max_rows;
  long page = sysconf(_SC_PAGESIZE);
  size_t len = (size_t(max_rows) * sizeof(mt_unwind_row) + page - 1) / page * page;
  void* mem = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, rows_fd, 0);
  if (mem == MAP_FAILED) return Error::sys("mmap BPF map unwind_rows (needs BPF_F_MMAPABLE)");
  m->rows_mem_ = mem;
  m->rows_mem_len_ = len;
  m->free_[0] = max_rows;
  return m;
}

UnwindMaps::~UnwindMaps() {
  if (rows_mem_) munmap(rows_mem_, rows_mem_len_);
}

Result<uint32_t> UnwindMaps::alloc(uint32_t n) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < n) continue;
    uint32_t first = it->first, count = it->second;
    free_.erase(it);
    if (count > n) free_[first + n] = count - n;
    return first;
  }
  return Error::msg("unwind rows array full (" + std::to_string(max_rows_) + " rows): need " +
                    std::to_string(n) + " more; raise unwind_rows max_entries");
}

void UnwindMaps::release(uint32_t first, uint32_t n) {
  auto [it, ok] = free_.emplace(first, n);
  if (auto nx = std::next(it); nx != free_.end() && it->first + it->second == nx->first) {
    it->second += nx->second;
    free_.erase(nx);
  }
  if (it != free_.begin()) {
    auto pv = std::prev(it);
    if (pv->first + pv->second == it->first) {
      pv->second += it->second;
      free_.erase(it);
    }
  }
}

Result<uint32_t> UnwindMaps::load_rows(const std::shared_ptr<const CfiTable>& t) {
  auto it = loaded_.find(t.get());
  if (it != loaded_.end()) {
    it->second.refs++;
    return it->second.first;
  }
  auto first = alloc(static_cast<uint32_t>(t->rows.size()));
  if (!first) return first.error();
  std::memcpy(static_cast<mt_unwind_row*>(rows_mem_) + *first, t->rows.data(),
              t->rows.size() * sizeof(mt_unwind_row));
  loaded_[t.get()] = Loaded{*first, 1};
  return *first;
}

void UnwindMaps::unref(const CfiTable* t) {
  auto it = loaded_.find(t);
  if (it == loaded_.end()) return;
  if (--it->second.refs == 0) {
    release(it->second.first, static_cast<uint32_t>(t->rows.size()));
    loaded_.erase(it);
  }
}

Result<void> UnwindMaps::add_mapping(pid_t pid, const ProcMapping& m, std::vector<Mapping>* out) {
  char mf[96];
  std::snprintf(mf, sizeof mf, "/proc/%d/map_files/%" PRIx64 "-%" PRIx64, pid, m.start, m.end);
  std::string what = m.path.empty() ? std::string(mf) : m.path;
  Fd fd(::open(mf, O_RDONLY | O_CLOEXEC));
  if (!fd.valid() && !m.path.empty() && m.path[0] == '/') {
    std::string alt = "/proc/" + std::to_string(pid) + "/root" + m.path;
    fd.reset(::open(alt.c_str(), O_RDONLY | O_CLOEXEC));
  }
  if (!fd.valid()) return Error::sys("open mapped file " + what + " of pid " + std::to_string(pid));
  auto t = store_.get(fd.get(), what);
  if (!t) return t.error();
  const CfiTable& table = **t;
  // load bias: runtime address = ELF vaddr + bias
  const LoadSegment* seg = nullptr;
  for (auto& s : table.segments)
    if (m.offset >= (s.offset & ~uint64_t(0xfff)) && m.offset < s.offset + s.filesz && s.exec) seg = &s;
  if (!seg)
    for (auto& s : table.segments)
      if (m.offset >= (s.offset & ~uint64_t(0xfff)) && m.offset < s.offset + std::max<uint64_t>(s.filesz, 1)) seg = &s;
  if (!seg) return Error::msg("mapping of " + what + " at file offset " + std::to_string(m.offset) + " matches no PT_LOAD");
  uint64_t load_bias = m.start - m.offset - (seg->vaddr - seg->offset);
  Mapping mp{m.start, m.end, load_bias + table.base, table.rows.empty() ? nullptr : *t};
  out->push_back(std::move(mp));
  return {};
}

Result<void> UnwindMaps::publish(pid_t pid) {
  auto& ms = procs_[pid];
  std::sort(ms.begin(), ms.end(), [](const Mapping& a, const Mapping& b) { return a.start < b.start; });
  auto v = std::make_unique<mt_unwind_proc>();
  std::memset(v.get(), 0, sizeof(*v));
  v->gen = ++gen_;  // never 0: BPF's row cache starts zeroed
  if (v->gen == 0) v->gen = ++gen_;
  for (auto& m : ms) {
    if (v->nr >= MT_UNWIND_MAX_MAPPINGS) break;
    mt_unwind_mapping& o = v->m[v->nr++];
    o.start = m.start;
    o.end = m.end;
    o.bias = m.bias;
    if (m.table) {
      o.first_row = loaded_.at(m.table.get()).first;
      o.nr_rows = static_cast<uint32_t>(m.table->rows.size());
    }
  }
  __u32 key = static_cast<__u32>(pid);
  if (bpf_map_update_elem(procs_fd_, &key, v.get(), BPF_ANY) != 0)
    return Error::sys("update BPF map unwind_procs for pid " + std::to_string(pid));
  bump_epoch(v->gen);  // after the value: a walk stamped with the old epoch is dropped
  if (ms.size() > MT_UNWIND_MAX_MAPPINGS)
    return Error::msg("pid " + std::to_string(pid) + ": more than " + std::to_string(MT_UNWIND_MAX_MAPPINGS) +
                      " executable mappings; the rest use frame pointers");
  return {};
}

Result<void> UnwindMaps::add_process(pid_t pid) {
  auto maps = read_proc_maps(pid);
  if (!maps) return maps.error();
  std::vector<Mapping> fresh;
  std::string errors;
  auto& old = procs_[pid];
  for (auto& m : *maps) {
    if (m.perms.size() < 3 || m.perms[2] != 'x' || m.inode == 0 || m.path.empty() || m.path[0] != '/') continue;
    // Unchanged mapping: keep it (and its reference).
    auto same = std::find_if(old.begin(), old.end(), [&](const Mapping& o) { return o.start == m.start && o.end == m.end; });
    if (same != old.end()) {
      fresh.push_back(std::move(*same));
      old.erase(same);
      continue;
    }
    std::vector<Mapping> one;
    if (auto r = add_mapping(pid, m, &one); !r) {
      failed_++;
      errors += (errors.empty() ? "" : "; ") + r.error().message;
      continue;
    }
    if (one[0].table) {
      if (auto f = load_rows(one[0].table); !f) {
        failed_++;
        errors += (errors.empty() ? "" : "; ") + f.error().message;
        one[0].table = nullptr;
      }
    }
    fresh.push_back(std::move(one[0]));
  }
  for (auto& o : old)
    if (o.table) unref(o.table.get());
  old = std::move(fresh);
  auto r = publish(pid);
  if (!r) return r;
  if (!errors.empty()) return Error::msg("unwind tables for pid " + std::to_string(pid) + ": " + errors);
  return {};
}

Result<void> UnwindMaps::on_exec_mapping(pid_t pid, uint64_t start, uint64_t end, uint64_t offset,
                                         const std::string& path) {
  auto& ms = procs_[pid];
  // A new mapping replaces whatever it overlaps.
  for (auto it = ms.begin(); it != ms.end();) {
    if (it->start < end && start < it->end) {
      if (it->table) unref(it->table.get());
      it = ms.erase(it);
    } else {
      ++it;
    }
  }
  ProcMapping m{start, end, offset, "r-xp", 1, path};
  std::vector<Mapping> one;
  Result<void> err;
  if (auto r = add_mapping(pid, m, &one); !r) {
    failed_++;
    err = r;
  } else {
    if (one[0].table) {
      if (auto f = load_rows(one[0].table); !f) {
        failed_++;
        err = f.error();
        one[0].table = nullptr;
      }
    }
    ms.push_back(std::move(one[0]));
  }
  auto r = publish(pid);
  if (!err) return err;
  return r;
}

void UnwindMaps::remove_process(pid_t pid) {
  auto it = procs_.find(pid);
  if (it == procs_.end()) return;
  for (auto& m : it->second)
    if (m.table) unref(m.table.get());
  procs_.erase(it);
  __u32 key = static_cast<__u32>(pid);
  bpf_map_delete_elem(procs_fd_, &key);
  if (++gen_ == 0) ++gen_;
  bump_epoch(gen_);
}

void UnwindMaps::bump_epoch(uint32_t gen) {
  if (epoch_fd_ < 0) return;
  __u32 zero = 0;
  __u64 v = gen;
  bpf_map_update_elem(epoch_fd_, &zero, &v, BPF_ANY);
}

UnwindStats UnwindMaps::stats() const {
  UnwindStats s;
  s.processes = procs_.size();
  for (auto& [pid, ms] : procs_) {
    s.mappings += ms.size();
    for (auto& m : ms) s.mappings_no_cfi += m.table == nullptr;
  }
  s.files = loaded_.size();
  for (auto& [t, l] : loaded_) s.rows += t->rows.size();
  s.row_bytes = s.rows * sizeof(mt_unwind_row);
  s.rows_capacity = max_rows_;
  s.map_bytes = rows_mem_len_ + procs_.size() * sizeof(mt_unwind_proc);
  s.failed = failed_;
  return s;
}

}  // namespace memtrace::unwind
