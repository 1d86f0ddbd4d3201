// text_table.h: the plain-text tables the examples' reports print (examples/async_grpo,
// examples/simulator): rows of cells, the first column left-aligned, the others right-aligned,
// two spaces apart.
//
//   std::string t = examples::aligned_table({{"", "sync", "laminar"}, {"samples/s", "117.3", "265.8"}}, true);
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

namespace examples {

// With `rule`, a line of dashes as wide as the table under the first row.
inline std::string aligned_table(const std::vector<std::vector<std::string>>& rows, bool rule) {
  std::vector<std::size_t> width;
  for (const auto& r : rows) {
    width.resize(std::max(width.size(), r.size()), 0);
    for (std::size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::size_t total_width = width.empty() ? 0 : width[0];
  for (std::size_t i = 1; i < width.size(); ++i) total_width += 2 + width[i];
  std::string out;
  for (std::size_t ri = 0; ri < rows.size(); ++ri) {
    if (rows[ri].empty()) continue;
    out += fmt::format("{:<{}}", rows[ri][0], width[0]);
    for (std::size_t i = 1; i < rows[ri].size(); ++i) out += fmt::format("  {:>{}}", rows[ri][i], width[i]);
    out += '\n';
    if (ri == 0 && rule) out += std::string(total_width, '-') + '\n';
  }
  return out;
}

}  // namespace examples
