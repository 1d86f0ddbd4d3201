// temp_dir.h: a scratch directory for a test's files, and reading one back whole.
//
//   laminar::testing::TempDir dir("grpo_report");
//   write_report(dir.path() / "report.json");
//   REQUIRE(laminar::testing::read_all(dir.path() / "report.json").find("\"steps\"") != std::string::npos);
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include <catch2/catch.hpp>

namespace laminar::testing {

// A fresh directory under the system's temporary directory, named after `prefix`, removed with
// everything in it when the TempDir goes.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / (std::string(prefix) + "_XXXXXX")).string();
    REQUIRE(mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The file's bytes; empty when it cannot be read.
inline std::string read_all(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace laminar::testing
