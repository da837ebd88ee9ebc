// What tests/report/html_check.js saw, checked the same way on every page
// (the trace's report and the diff's): no error, nothing fetched but the
// page itself, a click on a frame that zoomed (the frame as wide as the
// graph) and a reset that undid it, a search that summed what it matched.
#pragma once
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace memtrace::testing {

inline void expect_page_used(const nlohmann::json& o, const std::string& page) {
  EXPECT_EQ(o["errors"], nlohmann::json::array());
  EXPECT_EQ(o["requests"], nlohmann::json::array({"file://" + page}));  // nothing else was fetched
  const nlohmann::json& z = o["zoom"];
  ASSERT_TRUE(z["before"].is_object());
  double graph = z["before"]["graph"];
  EXPECT_LT(z["before"]["width"].get<double>(), graph - 10);
  EXPECT_NEAR(z["after"]["width"].get<double>(), graph, 0.5);
  EXPECT_NEAR(z["reset"]["width"].get<double>(), z["before"]["width"].get<double>(), 0.5);
  EXPECT_NE(o["search"].get<std::string>().find("search: "), std::string::npos);
}

}  // namespace memtrace::testing
