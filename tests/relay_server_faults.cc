// The fault options of relay_server_faults: examples/relay_server built again for the relay chain
// tests (relay_node_test), whose relays misbehave on purpose through laminar_testing's
// create_faulty_relay_node (src/relay_node/testing.h). The example declares these three hooks under
// LAMINAR_RELAY_SERVER_FAULTS and uses laminar's public API alone.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "laminar/relay_node.h"
#include "relay_node/testing.h"

namespace {

std::string g_corrupt;
std::uint32_t g_delay_chunk_ms = 0;
laminar::testing::RelayNodeFaults g_faults;

}  // namespace

void add_fault_options(CLI::App& app) {
  app.add_option("--corrupt", g_corrupt, "V:CHUNK: corrupt that chunk once on its way downstream (tests)");
  app.add_option("--stall-after", g_faults.stall_after_chunks, "hang after storing this many chunks (tests)");
  app.add_option("--delay-chunk-ms", g_delay_chunk_ms, "wait this long before sending each chunk downstream (tests)");
}

bool parse_fault_options() {
  if (!g_corrupt.empty()) {
    unsigned long long ver = 0, chunk = 0;
    if (std::sscanf(g_corrupt.c_str(), "%llu:%llu", &ver, &chunk) != 2) {
      std::fprintf(stderr, "relay_server: --corrupt takes V:CHUNK, not '%s'\n", g_corrupt.c_str());
      return false;
    }
    g_faults.corrupt_chunk_once = std::pair{laminar::Version(ver), std::uint32_t(chunk)};
  }
  g_faults.delay_each_chunk = std::chrono::milliseconds(g_delay_chunk_ms);
  return true;
}

laminar::Result<std::unique_ptr<laminar::RelayNode>> create_relay_node(std::shared_ptr<laminar::Transport> transport,
                                                                       std::shared_ptr<laminar::RelayStore> store,
                                                                       laminar::RelayNodeOptions options) {
  return laminar::testing::create_faulty_relay_node(std::move(transport), std::move(store), std::move(options),
                                                    g_faults);
}
