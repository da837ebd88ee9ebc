// Command-line side of src/loader/features.h (built into the memtrace-bpf
// executable, which links CLI11).
#pragma once
#include "loader/features.h"

namespace CLI {
class App;
}

namespace memtrace::loader {

void add_feature_options(CLI::App& app, FeatureOptions& f);
// `memtrace-bpf replay FILE [options]`: argv[0] is "replay".
int run_replay(int argc, char** argv);

}  // namespace memtrace::loader
