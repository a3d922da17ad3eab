#!/usr/bin/env bash
# Installs the Debian packages dssim needs (only the missing ones) and builds it in build/.
# Safe to re-run: a second run checks, finds nothing to do, and runs an incremental build.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libyaml-cpp-dev nlohmann-json3-dev libeigen3-dev libboost-program-options-dev catch2
  libsimgrid-dev
  libtorch-dev libgloo-dev libopenblas0-pthread
  python3 python3-matplotlib python3-dev pybind11-dev python3-pybind11
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: all ${#PACKAGES[@]} Debian packages present"
fi

# The NCCL communicator is compiled (not run) wherever the CUDA toolkit is present.
CUDA_FLAG=-DDSSIM_WITH_CUDA=OFF
if [ -x /usr/local/cuda/bin/nvcc ] && ls /usr/local/cuda/lib64/libnccl.so* >/dev/null 2>&1; then
  CUDA_FLAG=-DDSSIM_WITH_CUDA=ON
fi

BUILD_DIR=${DSSIM_BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$CUDA_FLAG"
fi
cmake --build "$BUILD_DIR" -j"$(nproc)"
