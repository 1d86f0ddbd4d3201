#!/usr/bin/env bash
# Installs every Debian package laminar needs. Idempotent: installs only what is missing,
# and runs apt-get update only when something is missing. CUDA comes from the toolkit on the machine.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libfmt-dev catch2 nlohmann-json3-dev libcli11-dev
  libucx-dev ucx-utils libdlpack-dev
  libbenchmark-dev libconcurrentqueue-dev
  libxxhash-dev libhwy-dev libsodium-dev
  clang libclang-rt-14-dev
  iproute2 procps
  libtorch-dev gnuplot-nox
  # libtorch calls libblas.so.3: OpenBLAS takes it over through the alternatives system, in place of
  # netlib's reference BLAS, about 20x slower (examples/async_grpo/blas.h checks what loaded).
  libopenblas0-pthread
  pybind11-dev python3-dev python3-numpy python3-pytest python3-torch
  python3-venv python3-pip python3-setuptools python3-wheel
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
