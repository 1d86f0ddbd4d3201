#!/usr/bin/env bash
# The README's test command: installs dependencies, builds with a preset (default: "default") and runs
# every test. Usage: scripts/test.sh [default|debug|asan|tsan] [all|concurrent]
# "concurrent" builds and runs only the tests whose threads or processes run against each other
# (CTest label "concurrent", target concurrent_tests; tests/CMakeLists.txt): what CI runs under TSan.
set -euo pipefail
preset="${1:-default}"
scope="${2:-all}"
cd "$(dirname "$0")/.."
case "$scope" in
  all) build_args=(); test_args=() ;;
  concurrent) build_args=(--target concurrent_tests); test_args=(-L concurrent) ;;
  *) echo "scripts/test.sh: unknown scope '$scope' (all or concurrent)" >&2; exit 2 ;;
esac
bash scripts/install_deps.sh
jobs="${LAMINAR_JOBS:-$(nproc)}"
# The Python packages install_deps.sh installs (NumPy, torch, pytest) belong to Debian's interpreter,
# which a python3 earlier on PATH (pyenv, conda) may lack.
python_args=()
[ -x /usr/bin/python3 ] && python_args=(-DPython3_EXECUTABLE=/usr/bin/python3)
cmake --preset "$preset" "${python_args[@]}"
cmake --build --preset "$preset" -j "$jobs" "${build_args[@]}"
ctest --preset "$preset" -j "$jobs" "${test_args[@]}"
