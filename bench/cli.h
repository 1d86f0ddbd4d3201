// Number checks for the benches' CLI11 options, with messages that name the bound (CLI11's
// PositiveNumber names a range up to DBL_MAX). A value that is not a number at all fails here too.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace laminar::bench {

// The value is a number of at least `min`.
inline CLI::Validator at_least(std::int64_t min) {
  const std::string bound = std::to_string(min);
  return CLI::Validator(
      [min, bound](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "'" + text + "' is not a number";
        return v < static_cast<double>(min) ? text + " is less than " + bound : std::string();
      },
      "AT LEAST " + bound, "AT_LEAST");
}

// The value is a number above zero.
inline CLI::Validator positive() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "'" + text + "' is not a number";
        return v > 0 ? std::string() : text + " is not positive";
      },
      "POSITIVE", "POSITIVE");
}

}  // namespace laminar::bench
