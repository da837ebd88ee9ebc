// "0x1f": addresses and offsets as every report prints them.
#pragma once
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>

namespace memtrace {

inline std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%" PRIx64, v);
  return b;
}

}  // namespace memtrace
