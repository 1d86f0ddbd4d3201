#!/usr/bin/env bash
# The README's first command: installs dependencies, builds the asynchronous GRPO example and runs it
# (by default the synchronous schedule, then laminar's, on one seed). Arguments go to async_grpo
# (`--help` lists them); the report lands in async_grpo_out/ unless --out says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh >/dev/null
cmake --preset default >/dev/null
cmake --build --preset default -j "${LAMINAR_JOBS:-$(nproc)}" --target async_grpo >/dev/null
exec build/default/examples/async_grpo/async_grpo "$@"
