#!/usr/bin/env bash
# The README's main command: installs dependencies, builds, and runs the most complete example.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target quickstart
./build/default/examples/quickstart
