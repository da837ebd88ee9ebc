// Timing a BPF program through BPF_PROG_TEST_RUN, for the micro-benchmarks
// here (copy_cost, helper_cost): each program repeats one operation `calls`
// times per run; the result is ns per operation, the best of 7 rounds of 200
// runs (the least disturbed by the rest of the machine), or a negative
// number if a run failed.
#pragma once

#include <bpf/bpf.h>

#include <algorithm>
#include <chrono>

inline double best_ns_per_call(int prog_fd, int calls)
{
    LIBBPF_OPTS(bpf_test_run_opts, opts);
    double best = 1e18;
    for (int round = 0; round < 7; round++) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int k = 0; k < 200; k++)
            if (bpf_prog_test_run_opts(prog_fd, &opts))
                return -1;
        const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
        best = std::min(best, dt.count() / 200 / calls);
    }
    return best;
}
