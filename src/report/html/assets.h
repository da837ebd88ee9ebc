// The HTML report's page, built into the program (src/report/html/embed.js
// writes html_assets.cpp from page.html, app.js, app.css and the npm
// libraries they inline): the page up to where the data goes, and after it.
#pragma once
#include <string_view>

namespace memtrace::report::html_assets {

std::string_view head();
std::string_view tail();

}  // namespace memtrace::report::html_assets
