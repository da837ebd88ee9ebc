// Command-line side of src/loader/features.h (built into the memtrace-bpf
// executable, which links CLI11).
#pragma once
#include <string>
#include <vector>

#include "loader/features.h"
#include "report/outputs.h"

namespace CLI {
class App;
}

namespace memtrace::loader {

void add_feature_options(CLI::App& app, FeatureOptions& f);
// -o FILE (repeatable), --format, --folded-value: for tracing and replay.
void add_output_options(CLI::App& app, std::vector<std::string>& outputs, std::string& format,
                        std::string& folded_value);
// The outputs of the run (report/outputs.h: plan_outputs), the primary
// output's format ("text" or "json") and the folded value; "" or one line
// saying what is wrong.
std::string plan_output_options(const std::vector<std::string>& outputs, const std::string& format,
                                const std::string& folded_value, std::vector<report::OutputSpec>& specs,
                                std::string& primary_format, report::FoldedValue& value);
// `memtrace-bpf replay FILE [options]`: argv[0] is "replay".
int run_replay(int argc, char** argv);

}  // namespace memtrace::loader
