#!/usr/bin/env bash
# The README's test command: installs dependencies, builds with a preset (default: "default") and runs
# every test. Usage: scripts/test.sh [default|debug|asan|tsan]
set -euo pipefail
preset="${1:-default}"
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
jobs="${LAMINAR_JOBS:-$(nproc)}"
cmake --preset "$preset"
cmake --build --preset "$preset" -j "$jobs"
ctest --preset "$preset" -j "$jobs"
