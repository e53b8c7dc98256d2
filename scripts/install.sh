#!/usr/bin/env bash
# Builds libtboost (cargo, release) and installs the C ABI into PREFIX:
#   PREFIX/include/tboost.h
#   PREFIX/lib/libtboost.a, libtboost.so -> libtboost.so.<ABI> -> libtboost.so.<version>
#   PREFIX/lib/cmake/tboost/ (find_package(tboost CONFIG)), PREFIX/lib/pkgconfig/tboost.pc
# Usage: scripts/install.sh PREFIX [BUILD_DIR]
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 PREFIX [BUILD_DIR]" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=$1
BUILD=${2:-$ROOT/target/cmake-install}
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTBOOST_BUILD_TESTS=OFF -DTBOOST_INSTALL=ON \
  -DTBOOST_CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
cmake --build "$BUILD"
cmake --install "$BUILD" --prefix "$PREFIX"
