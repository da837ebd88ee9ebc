// A file's whole content ("" if it cannot be read): the -o files the tests check.
#pragma once
#include <fstream>
#include <sstream>
#include <string>

namespace memtrace::testing {

inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace memtrace::testing
