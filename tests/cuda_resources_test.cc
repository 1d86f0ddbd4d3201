// Reads the ptxas report written at build time (cuda/CMakeLists.txt) and fails on any register
// spill, and when an architecture the project promises is missing from it.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

namespace {

std::string read_report() {
  const char* path = std::getenv("LAMINAR_CUDA_RESOURCE_REPORT");
  REQUIRE(path != nullptr);
  std::ifstream in(path);
  INFO("report " << path);
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("no CUDA kernel spills registers on any architecture", "[cuda][resources]") {
  const std::string report = read_report();
  const std::regex entry(R"(Compiling entry function '([^']+)' for '(sm_[0-9a-z]+)')");
  const std::regex spill(R"((\d+) bytes spill stores, (\d+) bytes spill loads)");
  int entries = 0, spill_lines = 0;
  std::string current = "?";
  std::istringstream lines(report);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, entry)) {
      current = m[1].str() + " (" + m[2].str() + ")";
      ++entries;
    } else if (std::regex_search(line, m, spill)) {
      ++spill_lines;
      INFO(current << ": " << line);
      CHECK(std::stoll(m[1].str()) == 0);
      CHECK(std::stoll(m[2].str()) == 0);
    }
  }
  CHECK(entries > 0);
  CHECK(spill_lines >= entries);
}

TEST_CASE("every kernel is built for sm_80 and sm_90a", "[cuda][resources]") {
  const std::string report = read_report();
  CHECK(report.find("for 'sm_80'") != std::string::npos);
  CHECK(report.find("for 'sm_90a'") != std::string::npos);
}
