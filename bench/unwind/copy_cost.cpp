// copy_cost: ns per bpf_probe_read_user of this process's memory, by size and
// destination (what the BPF unwinder's window reads cost; see
// bpf/unwind.bpf.h, mt_memo_plan). Each cell: best of 7 rounds of 200
// BPF_PROG_TEST_RUN calls of a program that copies 1000 times; the "loop"
// row (len 0) is the bpf_loop step alone.
//   sudo build/bench/unwind/copy_cost
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "copy_cost.skel.h"
#include "test_run.h"

namespace {

alignas(64) unsigned char g_src[16384];

// ns per copy, or a negative number if the program could not be loaded.
double measure(unsigned dest, unsigned len)
{
    copy_cost* s = copy_cost__open();
    if (!s)
        return -1;
    s->rodata->src = reinterpret_cast<unsigned long>(g_src);
    s->rodata->len = len;
    s->rodata->dest = dest;
    s->rodata->iters = 1000;
    if (copy_cost__load(s)) {
        copy_cost__destroy(s);
        return -1;
    }
    const double ns = best_ns_per_call(bpf_program__fd(s->progs.copy_cost), 1000);
    copy_cost__destroy(s);
    return ns;
}

}  // namespace

int main()
{
    std::memset(g_src, 0x5a, sizeof g_src);
    const char* names[] = {"per-CPU array value", "array value", "BPF stack"};
    std::printf("| destination | len | ns per copy |\n|---|---:|---:|\n");
    for (unsigned dest = 0; dest < 3; dest++) {
        std::vector<unsigned> lens = {0, 8, 16, 64};
        if (dest < 2)
            lens.insert(lens.end(), {512, 2048, 4096, 8192});
        for (unsigned len : lens) {
            const double ns = measure(dest, len);
            if (ns < 0) {
                std::fprintf(stderr, "copy_cost: BPF program not loaded or run (root? BPF?)\n");
                return 1;
            }
            std::printf("| %s | %u%s | %.1f |\n", names[dest], len, len ? "" : " (loop only)", ns);
        }
    }
    return 0;
}
