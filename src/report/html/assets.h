// The HTML report's pages, built into the program (src/report/html/embed.js
// writes html_assets.cpp from page.html, diff.html, the scripts and styles
// and the npm libraries they inline).
#pragma once
#include <string_view>

namespace memtrace::report::html_assets {

struct Page {
  std::string_view head, tail;  // the page up to where the data goes, and after it
};
Page report();  // page.html: one trace (report::write_html)
Page diff();    // diff.html: memtrace-bpf diff A B (report::write_diff_html)

}  // namespace memtrace::report::html_assets
