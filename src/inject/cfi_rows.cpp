#include "inject/cfi_rows.h"

#include <elf.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "unwind/unwind_maps.h"

namespace memtrace::inject {

CfiRows build_cfi_rows(pid_t pid, const std::vector<procfs::Mapping>& maps, unwind::TableStore* store) {
  CfiRows out;
  auto t0 = std::chrono::steady_clock::now();
  std::map<const unwind::CfiTable*, uint32_t> first;  // a file's rows, once
  for (const auto& m : maps) {
    if (!m.exec() || !m.file()) continue;
    std::string what;
    Fd fd = unwind::open_mapped_file(pid, m, &what);
    auto t = fd.valid() ? store->get(fd.get(), what) : Result<std::shared_ptr<const unwind::CfiTable>>(Error::sys("open " + what));
    if (!t) {
      out.mappings_without++;
      if (out.first_error.empty()) out.first_error = t.error().message;
      continue;
    }
    const unwind::CfiTable& table = **t;
    auto bias = unwind::row_bias(table, m.start, m.offset);
    if (!bias || table.rows.empty() || table.machine != EM_X86_64 ||
        table.rows.size() > UINT32_MAX - out.rows.size()) {
      out.mappings_without++;
      continue;
    }
    auto [it, fresh] = first.emplace(&table, static_cast<uint32_t>(out.rows.size()));
    if (fresh) out.rows.insert(out.rows.end(), table.rows.begin(), table.rows.end());
    mt_inj_cfi_mod mod{};
    mod.start = m.start;
    mod.end = m.end;
    mod.bias = *bias;
    mod.first = it->second;
    mod.count = static_cast<uint32_t>(table.rows.size());
    out.mods.push_back(mod);
  }
  std::sort(out.mods.begin(), out.mods.end(),
            [](const mt_inj_cfi_mod& a, const mt_inj_cfi_mod& b) { return a.start < b.start; });
  out.build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace memtrace::inject
