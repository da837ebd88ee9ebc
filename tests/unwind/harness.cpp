#include "harness.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <cxxabi.h>
#include <signal.h>
#include <sys/personality.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include "elf/elf_file.h"
#include "unwind_test.skel.h"

namespace memtrace::unwind::harness {
namespace {

struct SkelDeleter {
  void operator()(unwind_test* s) const { unwind_test__destroy(s); }
};

char task_state(pid_t pid, pid_t tid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat");
  std::string s;
  std::getline(in, s);
  auto p = s.rfind(')');
  if (p == std::string::npos || p + 2 >= s.size()) return 0;
  return s[p + 2];
}

struct Ctx {
  Run* run;
  UnwindMaps* maps;
  bool stop_after_first;
  bool got_stack = false;
  std::vector<pid_t> stopped;  // tids stopped by the mmap program
};

int on_event(void* arg, void* data, size_t size) {
  auto* c = static_cast<Ctx*>(arg);
  auto* h = static_cast<mt_hdr*>(data);
  if (h->kind == MT_EV_STACK && size >= MT_STACK_HDR_BYTES) {
    auto* s = static_cast<mt_stack*>(data);
    if (s->nr > MT_MAX_FRAMES || size < MT_STACK_BYTES(size_t{s->nr})) return 0;  // (variable-size record)
    Stack st;
    st.count = 1;
    st.flags = s->h.flags;
    st.ips.assign(s->ips, s->ips + s->nr);
    c->run->stacks.push_back(std::move(st));
    c->got_stack = true;
  } else if (h->kind == MT_EV_LIBMAP) {
    c->stopped.push_back(static_cast<pid_t>(h->tid));
  }
  return 0;
}

}  // namespace

Result<Run> trace(const std::vector<std::string>& argv, const Options& opt) {
  Run run;
  pid_t pid = fork();
  if (pid < 0) return Error::sys("fork");
  if (pid == 0) {
    if (opt.no_aslr) personality(ADDR_NO_RANDOMIZE);
    raise(SIGSTOP);
    std::vector<char*> a;
    for (auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execvp(a[0], a.data());
    _exit(127);
  }
  run.pid = pid;
  int st = 0;
  if (waitpid(pid, &st, WUNTRACED) != pid || !WIFSTOPPED(st)) return Error::msg("child did not stop");
  auto kill_child = [&] {
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  };

  std::unique_ptr<unwind_test, SkelDeleter> skel(unwind_test__open());
  if (!skel) {
    kill_child();
    return Error::sys("open BPF skeleton unwind_test");
  }
  skel->rodata->target_tgid = static_cast<__u32>(pid);
  skel->rodata->mark_size = opt.mark_size;
  skel->rodata->unwind_disabled = opt.unwind ? 0 : 1;
  if (int e = unwind_test__load(skel.get()); e) {
    kill_child();
    return Error::sys("load BPF skeleton unwind_test", -e);
  }
  LIBBPF_OPTS(bpf_uprobe_opts, uo, .func_name = "malloc");
  bpf_link* l1 = bpf_program__attach_uprobe_opts(skel->progs.on_malloc, pid,
                                                 "/lib/x86_64-linux-gnu/libc.so.6", 0, &uo);
  if (!l1) {
    kill_child();
    return Error::sys("attach uprobe malloc in libc.so.6");
  }
  skel->links.on_malloc = l1;
  bpf_link* l2 = bpf_program__attach(skel->progs.on_mmap);
  if (!l2) {
    kill_child();
    return Error::sys("attach tracepoint sys_enter_mmap (tracefs mounted?)");
  }
  skel->links.on_mmap = l2;
  auto maps = UnwindMaps::create(skel->maps.unwind_shards, skel->maps.unwind_procs, skel->maps.unwind_epoch);
  if (!maps) {
    kill_child();
    return maps.error();
  }
  if (opt.files_index) (*maps)->set_files_map(bpf_map__fd(skel->maps.unwind_files));
  Ctx ctx{&run, maps->get(), opt.stop_after_first, false, {}};
  ring_buffer* rb = ring_buffer__new(bpf_map__fd(skel->maps.rb), on_event, &ctx, nullptr);
  if (!rb) {
    kill_child();
    return Error::sys("ring buffer");
  }
  int stats_fd = bpf_enable_stats(BPF_STATS_RUN_TIME);

  kill(pid, SIGCONT);
  auto t0 = std::chrono::steady_clock::now();
  bool exited = false;
  while (!exited) {
    ring_buffer__poll(rb, 20);
    for (pid_t tid : ctx.stopped) {
      // Wait until the group stop has happened (the mmap has returned), then
      // load the new file's table and let the process go on.
      for (int i = 0; i < 2000 && task_state(pid, tid) != 'T' && task_state(pid, tid) != 't'; i++)
        usleep(500);
      if (auto r = (*maps)->add_process(pid); !r) run.table_errors += r.error().message + "\n";
      if (!opt.publish) {
        __u32 key = static_cast<__u32>(pid);
        bpf_map_delete_elem(bpf_map__fd(skel->maps.unwind_procs), &key);
      }
      if (auto m = procfs::read_maps(pid)) run.maps = std::move(*m);
      kill(pid, SIGCONT);
    }
    ctx.stopped.clear();
    if (run.maps.empty()) {
      if (auto m = procfs::read_maps(pid)) run.maps = std::move(*m);
    }
    if (ctx.got_stack && opt.stop_after_first) {
      if (auto m = procfs::read_maps(pid); m && !m->empty()) run.maps = std::move(*m);
      break;
    }
    if (waitpid(pid, &st, WNOHANG) == pid && (WIFEXITED(st) || WIFSIGNALED(st))) {
      exited = true;
      run.exit_status = st;
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(opt.timeout_ms)) break;
  }
  ring_buffer__poll(rb, 0);
  if (!exited) kill_child();
  ring_buffer__free(rb);

  // Counts per stack (the map key is the stack id; stacks arrive in order of
  // first sight, ids recomputed here would need the hash: read all counts and
  // match by first-seen order through the id kept in the record instead).
  // Simpler: sum counts and attribute by id.
  {
    int fd = bpf_map__fd(skel->maps.stack_counts);
    __u64 key = 0, next, val;
    std::map<__u64, __u64> counts;
    void* prev = nullptr;
    while (bpf_map_get_next_key(fd, prev, &next) == 0) {
      if (bpf_map_lookup_elem(fd, &next, &val) == 0) counts[next] = val;
      key = next;
      prev = &key;
    }
    (void)counts;
    run.table_stats = (*maps)->stats();
    // attach counts: the harness records stack ids in Stack::count order
    // (see on_event); ids are not kept, so recompute them the BPF way.
    for (auto& s : run.stacks) {
      __u64 h = 0xcbf29ce484222325ULL;
      for (auto ip : s.ips) {
        h ^= ip;
        h *= 0x100000001b3ULL;
        h ^= h >> 29;
      }
      h = h ? h : 1;
      h ^= s.flags;
      auto it = counts.find(h);
      if (it != counts.end()) s.count = it->second;
    }
  }
  {
    int fd = bpf_map__fd(skel->maps.unwind_counters);
    int ncpu = libbpf_num_possible_cpus();
    std::vector<__u64> v(ncpu);
    for (__u32 k = 0; k < MT_UC_COUNT; k++)
      if (bpf_map_lookup_elem(fd, &k, v.data()) == 0)
        for (auto x : v) run.counters[k] += x;
  }
  bpf_prog_info info{};
  __u32 len = sizeof(info);
  if (bpf_obj_get_info_by_fd(bpf_program__fd(skel->progs.on_malloc), &info, &len) == 0) {
    run.prog_run_ns = info.run_time_ns;
    run.prog_run_cnt = info.run_cnt;
  }
  if (stats_fd >= 0) close(stats_fd);
  return run;
}

std::string Symbolizer::file(uint64_t ip) {
  for (auto& m : maps_)
    if (ip >= m.start && ip < m.end) return m.path;
  return "";
}

namespace {
std::string demangle(const std::string& n) {
  int status = 0;
  char* d = abi::__cxa_demangle(n.c_str(), nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : n;
  free(d);
  return out;
}
struct Elves {
  std::shared_ptr<elf::ElfFile> file, syms;
};
}  // namespace

bool Symbolizer::find(uint64_t ip, std::vector<std::string>* names) {
  const unwind::ProcMapping* map = nullptr;
  for (auto& m : maps_)
    if (ip >= m.start && ip < m.end) map = &m;
  if (!map || map->path.empty() || map->path[0] != '/') return false;
  auto& slot = elves_[map->path];
  if (!slot) {
    auto e = elf::ElfFile::open(map->path);
    if (!e) return false;
    auto el = std::make_shared<Elves>();
    el->file = std::make_shared<elf::ElfFile>(std::move(*e));
    el->syms = el->file;
    const std::string& bid = el->file->build_id();
    if (!el->file->has_symtab() && bid.size() > 2) {
      auto d = elf::ElfFile::open("/usr/lib/debug/.build-id/" + bid.substr(0, 2) + "/" + bid.substr(2) + ".debug");
      if (d && d->has_symtab()) el->syms = std::make_shared<elf::ElfFile>(std::move(*d));
    }
    slot = el;
  }
  auto* el = static_cast<Elves*>(slot.get());
  const elf::Segment* seg = nullptr;
  for (auto& s : el->file->segments())
    if (map->offset >= (s.offset & ~uint64_t(0xfff)) && map->offset < s.offset + s.filesz) seg = &s;
  if (!seg) return false;
  uint64_t bias = map->start - map->offset - (seg->vaddr - seg->offset);
  uint64_t va = ip - 1 - bias;  // return address: the call is before it
  const elf::Symbol* best = nullptr;
  for (auto& s : el->syms->symbols()) {
    if ((s.type != 2 /* STT_FUNC */ && s.type != 10 /* STT_GNU_IFUNC */) || s.vaddr > va) continue;
    if (s.size && va >= s.vaddr + s.size) continue;
    if (!best || s.vaddr > best->vaddr || (s.vaddr == best->vaddr && !s.dynamic && best->dynamic)) best = &s;
  }
  if (!best) return false;
  names->push_back(demangle(best->name));
  for (auto& s : el->syms->symbols())
    if (s.vaddr == best->vaddr && (s.type == 2 || s.type == 10) && s.name != best->name)
      names->push_back(demangle(s.name));
  return true;
}

std::string Symbolizer::name(uint64_t ip) {
  std::vector<std::string> n;
  return find(ip, &n) ? n[0] : "??";
}

std::vector<std::string> Symbolizer::aliases(uint64_t ip) {
  std::vector<std::string> n;
  find(ip, &n);
  return n;
}

}  // namespace memtrace::unwind::harness
