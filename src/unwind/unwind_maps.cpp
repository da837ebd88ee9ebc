#include "unwind/unwind_maps.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "common/fd.h"

namespace memtrace::unwind {

Result<std::unique_ptr<UnwindMaps>> UnwindMaps::create(const bpf_map* shards, const bpf_map* procs,
                                                       const bpf_map* epoch, size_t cap_bytes) {
  return create_fds(bpf_map__fd(shards), bpf_map__max_entries(shards), bpf_map__fd(procs),
                    epoch ? bpf_map__fd(epoch) : -1, cap_bytes);
}

Result<std::unique_ptr<UnwindMaps>> UnwindMaps::create_fds(int shards_fd, uint32_t max_shards, int procs_fd,
                                                           int epoch_fd, size_t cap_bytes) {
  if (shards_fd < 0 || procs_fd < 0) return Error::msg("unwind maps: BPF maps not created (skeleton not loaded?)");
  std::unique_ptr<UnwindMaps> m(new UnwindMaps());
  m->shards_fd_ = shards_fd;
  m->max_shards_ = max_shards;
  m->procs_fd_ = procs_fd;
  m->epoch_fd_ = epoch_fd;
  m->cap_bytes_ = std::max(cap_bytes, kShardBytes);
  size_t initial = std::min<size_t>({kInitialShards, m->cap_bytes_ / kShardBytes, max_shards});
  if (auto r = m->add_shards(initial); !r) return r.error();
  return m;
}

UnwindMaps::~UnwindMaps() {
  for (auto& s : shards_) munmap(s.mem, kShardBytes);  // the maps go with unwind_shards
}

namespace {
double ms_since(const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
std::string mib(size_t b) {
  char out[32];
  if (b < (size_t(1) << 20))
    std::snprintf(out, sizeof out, "%zu KiB", (b + 1023) >> 10);
  else
    std::snprintf(out, sizeof out, "%.1f MiB", double(b) / double(1 << 20));
  return out;
}
}  // namespace

// k more shards at the end of the row space: maps created, mapped for
// writing, put in unwind_shards. Each insertion waits for an RCU grace
// period in the kernel (~7-17 ms here), so k > 1 are inserted from k
// threads at once: their waits overlap (libLLVM needs 4 shards).
Result<void> UnwindMaps::add_shards(size_t k) {
  if (shards_.size() + k > max_shards_) return Error::msg("unwind_shards full");
  auto t0 = std::chrono::steady_clock::now();
  std::vector<Shard> fresh(k);
  for (auto& s : fresh) {
    LIBBPF_OPTS(bpf_map_create_opts, opts, .map_flags = BPF_F_MMAPABLE);
    s.fd.reset(bpf_map_create(BPF_MAP_TYPE_ARRAY, "mt_rows", sizeof(__u32), sizeof(mt_unwind_row), kShardRows, &opts));
    if (!s.fd.valid()) return Error::sys("create an unwind rows shard");
    s.mem = mmap(nullptr, kShardBytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd.get(), 0);
    if (s.mem == MAP_FAILED) {
      s.mem = nullptr;
      return Error::sys("mmap an unwind rows shard");
    }
  }
  std::vector<int> err(k, 0);
  auto insert = [&](size_t i) {
    uint32_t slot = static_cast<uint32_t>(shards_.size() + i);
    int fd = fresh[i].fd.get();
    if (bpf_map_update_elem(shards_fd_, &slot, &fd, BPF_ANY) != 0) err[i] = errno;
  };
  if (k == 1) {
    insert(0);
  } else {
    std::vector<std::thread> th;
    for (size_t i = 0; i < k; i++) th.emplace_back(insert, i);
    for (auto& t : th) t.join();
  }
  // Kept in order up to the first failure (the row space stays contiguous);
  // the rest are removed again.
  size_t ok = 0;
  while (ok < k && err[ok] == 0) ok++;
  for (size_t i = ok; i < k; i++) {
    uint32_t slot = static_cast<uint32_t>(shards_.size() + i);
    if (err[i] == 0) bpf_map_delete_elem(shards_fd_, &slot);
  }
  for (size_t i = 0; i < k; i++) {
    if (i < ok) {
      uint32_t first = space();
      shards_.push_back(std::move(fresh[i]));
      release(first, kShardRows);
    } else if (fresh[i].mem) {
      munmap(fresh[i].mem, kShardBytes);
    }
  }
  peak_bytes_ = std::max(peak_bytes_, shards_.size() * kShardBytes);
  load_ms_ += ms_since(t0);
  if (ok < k) return Error::sys("put an unwind rows shard into unwind_shards", err[ok]);
  return {};
}

Result<uint32_t> UnwindMaps::alloc(uint32_t n) {
  auto take = [&]() -> std::optional<uint32_t> {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < n) continue;
      uint32_t first = it->first, count = it->second;
      free_.erase(it);
      if (count > n) free_[first + n] = count - n;
      return first;
    }
    return std::nullopt;
  };
  // Shards to add for n rows: the free range at the end of the space (if
  // any) plus new ones; 0 if that would pass the cap.
  auto to_add = [&]() -> size_t {
    uint32_t tail = 0;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == space()) tail = last->second;
    }
    size_t add = (n - tail + kShardRows - 1) / kShardRows;
    if ((shards_.size() + add) * kShardBytes > cap_bytes_ || shards_.size() + add > max_shards_) return 0;
    return add;
  };
  if (auto f = take()) return *f;
  sweep(false);  // rows idle past kKeepSeconds
  if (auto f = take()) return *f;
  // Grow before dropping the rows kept for files no process maps now: a
  // build runs ar, as and their plugins (libLLVM: 2M rows, ~200 ms to
  // build) again within the minute, and a process allocates in a new
  // file's static constructors before the loader has its rows.
  if (size_t add = to_add()) {
    if (auto r = add_shards(add); !r) return r.error();
    if (auto f = take()) return *f;
  }
  sweep(true);
  if (auto f = take()) return *f;
  size_t add = to_add();
  if (add == 0)
    return Error::msg("its table (" + mib(size_t(n) * sizeof(mt_unwind_row)) +
                      ") would pass the cap on unwind tables (" + mib(cap_bytes_) +
                      ", --unwind-mb); frame pointers there");
  if (auto r = add_shards(add); !r) return r.error();
  if (auto f = take()) return *f;
  return Error::msg("no room for " + std::to_string(n) + " unwind rows");
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

void UnwindMaps::sweep(bool all) {
  auto now = std::chrono::steady_clock::now();
  for (auto it = loaded_.begin(); it != loaded_.end();) {
    auto& l = it->second;
    if (l.refs == 0 && (all || std::chrono::duration<double>(now - l.idle_since).count() >= kKeepSeconds)) {
      // Out of unwind_files before the rows can be handed to another file.
      for (const auto& f : l.files) {
        mt_unwind_file_key k{f.dev, f.ino};
        if (files_fd_ >= 0) bpf_map_delete_elem(files_fd_, &k);
      }
      release(l.first, static_cast<uint32_t>(l.table->rows.size()));
      it = loaded_.erase(it);
    } else {
      ++it;
    }
  }
  // Empty shards at the end go (each removal waits for a grace period too).
  while (shards_.size() > kInitialShards && !free_.empty()) {
    auto last = std::prev(free_.end());
    uint32_t start = space() - kShardRows;
    if (last->first + last->second != space() || last->first > start) break;
    uint32_t slot = static_cast<uint32_t>(shards_.size() - 1);
    bpf_map_delete_elem(shards_fd_, &slot);
    munmap(shards_.back().mem, kShardBytes);
    shards_.pop_back();
    if (last->first == start)
      free_.erase(last);
    else
      last->second -= kShardRows;
  }
}

Result<uint32_t> UnwindMaps::load_rows(const std::shared_ptr<const CfiTable>& t) {
  auto it = loaded_.find(t.get());
  if (it != loaded_.end()) {
    it->second.refs++;
    return it->second.first;
  }
  const size_t n = t->rows.size();
  if (n > (size_t(1) << MT_UNWIND_ROW_BITS))
    return Error::msg(over_cap_said_.insert(t.get()).second
                          ? t->path + ": " + std::to_string(n) + " unwind rows, more than one file may have"
                          : "");
  auto first = alloc(static_cast<uint32_t>(n));
  if (!first) {
    // Said once per file (every process mapping it would repeat it).
    if (!over_cap_said_.insert(t.get()).second) return Error::msg("");
    return Error::msg(t->path + ": " + first.error().message);
  }
  auto t0 = std::chrono::steady_clock::now();
  // Rows may cross shards: copied shard by shard.
  for (size_t done = 0; done < n;) {
    uint32_t g = *first + static_cast<uint32_t>(done);
    size_t in = std::min<size_t>(n - done, kShardRows - (g & MT_UNWIND_SHARD_MASK));
    std::memcpy(static_cast<mt_unwind_row*>(shards_[g >> MT_UNWIND_SHARD_BITS].mem) + (g & MT_UNWIND_SHARD_MASK),
                t->rows.data() + done, in * sizeof(mt_unwind_row));
    done += in;
  }
  load_ms_ += ms_since(t0);
  loaded_[t.get()] = Loaded{*first, 1, t, {}, {}};
  return *first;
}

void UnwindMaps::unref(const CfiTable* t) {
  auto it = loaded_.find(t);
  if (it == loaded_.end() || it->second.refs == 0) return;
  if (--it->second.refs == 0) it->second.idle_since = std::chrono::steady_clock::now();
}

std::optional<uint64_t> row_bias(const CfiTable& table, uint64_t start, uint64_t offset) {
  // load bias: runtime address = ELF vaddr + bias
  const elf::Segment* seg = nullptr;
  for (auto& s : table.segments)
    if (offset >= (s.offset & ~uint64_t(0xfff)) && offset < s.offset + s.filesz && (s.flags & PF_X)) seg = &s;
  if (!seg)
    for (auto& s : table.segments)
      if (offset >= (s.offset & ~uint64_t(0xfff)) && offset < s.offset + std::max<uint64_t>(s.filesz, 1)) seg = &s;
  if (!seg) return std::nullopt;
  uint64_t load_bias = start - offset - (seg->vaddr - seg->offset);
  return load_bias + table.base;
}

Fd open_mapped_file(pid_t pid, const ProcMapping& m, std::string* what) {
  char mf[96];
  std::snprintf(mf, sizeof mf, "/proc/%d/map_files/%" PRIx64 "-%" PRIx64, pid, m.start, m.end);
  *what = m.path.empty() ? std::string(mf) : m.path;
  Fd fd(::open(mf, O_RDONLY | O_CLOEXEC));
  if (!fd.valid() && !m.path.empty() && m.path[0] == '/') {
    std::string alt = "/proc/" + std::to_string(pid) + "/root" + m.path;
    fd.reset(::open(alt.c_str(), O_RDONLY | O_CLOEXEC));
  }
  return fd;
}

Result<void> UnwindMaps::add_mapping(pid_t pid, const ProcMapping& m, std::vector<Mapping>* out) {
  std::string what;
  Fd fd = open_mapped_file(pid, m, &what);
  if (!fd.valid()) return Error::sys("open mapped file " + what + " of pid " + std::to_string(pid));
  auto t0 = std::chrono::steady_clock::now();
  auto t = store_.get(fd.get(), what);
  build_ms_ += ms_since(t0);
  if (!t) return t.error();
  const CfiTable& table = **t;
  auto bias = row_bias(table, m.start, m.offset);
  if (!bias) {
    // No code of the file there: ld.so reserves a library's whole extent
    // with the first segment's protections before it maps the others, and
    // a read at that moment sees the tail past every PT_LOAD executable
    // (libclang-cpp at 0x3819000, under load). Kept without rows (frame
    // pointers there); the real mappings come with their own events.
    out->push_back(Mapping{m.start, m.end, 0, nullptr, {}});
    return {};
  }
  Mapping mp{m.start, m.end, *bias, table.rows.empty() ? nullptr : *t, {}};
  if (struct stat st; fstat(fd.get(), &st) == 0)
    mp.file = FileKey{(uint64_t(major(st.st_dev)) << 20) | minor(st.st_dev), st.st_ino};
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

Result<void> UnwindMaps::add_process(pid_t pid, const std::vector<ProcMapping>* given) {
  Result<std::vector<ProcMapping>> read = std::vector<ProcMapping>{};
  if (!given) {
    read = procfs::read_maps(pid);
    if (!read) return read.error();
    given = &*read;
  }
  std::vector<Mapping> fresh;
  std::string errors;
  uint64_t failed_here = 0;
  auto& old = procs_[pid];
  for (const auto& m : *given) {
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
      failed_here++;
      errors += (errors.empty() ? "" : "; ") + r.error().message;
      continue;
    }
    if (one[0].table) {
      if (auto f = load_rows(one[0].table); !f) {
        failed_++;
        if (!f.error().message.empty()) errors += (errors.empty() ? "" : "; ") + f.error().message;
        one[0].table = nullptr;
      } else {
        index_file(one[0]);
      }
    }
    fresh.push_back(std::move(one[0]));
  }
  for (auto& o : old)
    if (o.table) unref(o.table.get());
  old = std::move(fresh);
  auto r = publish(pid);
  if (!r) return r;
  if (!errors.empty()) {
    // Exited while its files were opened (a zombie's map_files are gone,
    // and so are its maps): nothing failed, nothing is left to unwind.
    if (auto now = procfs::read_maps(pid); !now || now->empty()) {
      failed_ -= failed_here;
      return Error::sys("pid " + std::to_string(pid) + " exited", ESRCH);
    }
    return Error::msg("unwind tables for pid " + std::to_string(pid) + ": " + errors);
  }
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
  ProcMapping m;
  m.start = start;
  m.end = end;
  m.offset = offset;
  m.perms = "r-xp";
  m.inode = 1;
  m.path = path;
  std::vector<Mapping> one;
  Result<void> err;
  if (auto r = add_mapping(pid, m, &one); !r) {
    failed_++;
    err = r;
  } else {
    if (one[0].table) {
      if (auto f = load_rows(one[0].table); !f) {
        failed_++;
        if (!f.error().message.empty()) err = f.error();
        one[0].table = nullptr;
      } else {
        index_file(one[0]);
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
  sweep(false);
}

void UnwindMaps::index_file(const Mapping& m) {
  if (files_fd_ < 0 || !m.table || m.file.ino == 0) return;
  auto it = loaded_.find(m.table.get());
  if (it == loaded_.end()) return;
  auto& files = it->second.files;
  if (std::find(files.begin(), files.end(), m.file) != files.end()) return;
  mt_unwind_file v{};
  v.base = m.table->base;
  v.first_row = it->second.first;
  v.nr_rows = static_cast<uint32_t>(m.table->rows.size());
  for (const auto& s : m.table->segments) {
    if (!(s.flags & PF_X) || v.nseg >= MT_UNWIND_FILE_SEGS) continue;
    v.seg[v.nseg++] = mt_unwind_file_seg{s.offset & ~uint64_t(0xfff), s.offset + s.filesz, s.vaddr - s.offset};
  }
  mt_unwind_file_key k{m.file.dev, m.file.ino};
  // A full map (8192 files) only costs those files the early rows.
  if (bpf_map_update_elem(files_fd_, &k, &v, BPF_ANY) == 0) files.push_back(m.file);
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
  for (auto& [t, l] : loaded_) {
    (l.refs ? s.files : s.files_kept)++;
    s.rows += t->rows.size();
  }
  s.row_bytes = s.rows * sizeof(mt_unwind_row);
  s.shards = shards_.size();
  s.map_bytes = shards_.size() * kShardBytes + procs_.size() * sizeof(mt_unwind_proc);
  s.peak_bytes = peak_bytes_;
  s.cap_bytes = cap_bytes_;
  s.over_cap = over_cap_said_.size();
  s.build_ms = build_ms_;
  s.load_ms = load_ms_;
  s.failed = failed_;
  return s;
}

}  // namespace memtrace::unwind
