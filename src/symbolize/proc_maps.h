// /proc/PID/maps, parsed.
#pragma once
#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"
#include "symbolize/symbolize.h"

namespace memtrace::symbolize {

// One line of /proc/PID/maps; false if the line is malformed.
bool parse_maps_line(std::string_view line, MappingInfo& out);
std::vector<MappingInfo> parse_maps(std::string_view text);
Result<std::vector<MappingInfo>> read_maps(pid_t pid);

}  // namespace memtrace::symbolize
