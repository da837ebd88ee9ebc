// helper_cost: ns per call of each helper an allocator probe calls
// (bpf/memtrace.bpf.c), measured alone: best of 7 rounds of 200
// BPF_PROG_TEST_RUN calls of a program that makes 1000 calls; the "loop" row
// is the bpf_loop step alone (subtract it). Why: on a kernel whose every
// return goes through a return thunk, a helper's call and return cost more
// than most helpers' work, so the probes' fixed part is their number of calls.
//   sudo build/bench/unwind/helper_cost
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include <cstdio>

#include "helper_cost.skel.h"
#include "test_run.h"

namespace {

// ns per step, or a negative number if the program could not be loaded.
double measure(unsigned mode)
{
    helper_cost* s = helper_cost__open();
    if (!s)
        return -1;
    s->rodata->mode = mode;
    s->rodata->iters = 1000;
    if (helper_cost__load(s)) {
        helper_cost__destroy(s);
        return -1;
    }
    const double ns = best_ns_per_call(bpf_program__fd(s->progs.helper_cost), 1000);
    helper_cost__destroy(s);
    return ns;
}

}  // namespace

int main()
{
    const char* names[] = {"loop only",
                           "bpf_ktime_get_ns",
                           "bpf_ktime_get_boot_ns",
                           "bpf_jiffies64",
                           "bpf_get_current_task_btf",
                           "bpf_get_current_pid_tgid",
                           "per-CPU array lookup + increment",
                           "bpf_task_storage_get (+ task_btf)",
                           "bpf_ringbuf_query",
                           "bpf_ringbuf_reserve + discard (72 B)",
                           "bpf_ringbuf_output (72 B, ring full after 14k)"};
    double loop = 0;
    std::printf("| helper | ns per step | minus the loop |\n|---|---:|---:|\n");
    for (unsigned mode = 0; mode < sizeof names / sizeof *names; mode++) {
        const double ns = measure(mode);
        if (ns < 0) {
            std::fprintf(stderr, "helper_cost: BPF program not loaded or run (root? BPF?)\n");
            return 1;
        }
        if (mode == 0)
            loop = ns;
        std::printf("| %s | %.1f | %.1f |\n", names[mode], ns, ns - loop);
    }
    return 0;
}
