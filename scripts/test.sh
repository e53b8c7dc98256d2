#!/usr/bin/env bash
# Runs every test of the project. Needs: the Rust toolchain, ../shared next to the
# checkout (or TBOOST_SHARED), network access to PyPI for the demo model (cached in
# ~/.cache/tboost), and for the embedding tests cmake, g++, libgtest-dev, golang-go,
# a JDK, libjna-java and cbindgen (.ci/run installs them all); for the Ascend bindings gcc (the CANN
# simulator), libclang-dev and a pinned bindgen-cli (the drift check of ascend-sys/src/raw.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "format check"
cargo fmt --all -- --check

step "demo model (downloaded once into the cache, verified by size and sha256)"
TBOOST_DEMO_MODEL="$(scripts/fetch-demo-model.sh)"
export TBOOST_DEMO_MODEL

step "ascend: CANN simulator build (ascend-sim) and bindings drift check (ascend-sys/src/raw.rs)"
TBOOST_ASCEND_SIM="$(scripts/build-ascend-sim.sh)"
export TBOOST_ASCEND_SIM
scripts/gen-ascend-bindings.sh --check

step "cargo test (workspace, release)"
cargo test --release --workspace

if [ -x scripts/test-embedding.sh ]; then
  step "embedding: C ABI header, CMake package, gtest, C++/Go/Java hosts, AddressSanitizer"
  scripts/test-embedding.sh
fi
step "all tests passed"
