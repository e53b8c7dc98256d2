#!/usr/bin/env bash
# Runs every test of the project. Needs the Rust toolchain, ../shared next to the checkout
# (or TBOOST_SHARED) and network access to Debian's packages, crates.io and PyPI on first
# use: scripts/setup.sh (run first) installs the embedding suite's tools (cmake, g++,
# libgtest-dev, golang-go, a JDK, libjna-java, valgrind, cbindgen, libclang and bindgen for
# the Ascend bindings' drift check...) when any is missing,
# and the demo model is downloaded once into ~/.cache/tboost.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "prerequisites (scripts/setup.sh: installs only what is missing)"
scripts/setup.sh
export PATH="${CARGO_HOME:-${HOME:-$(echo ~)}/.cargo}/bin:$PATH"

step "format check"
cargo fmt --all -- --check

step "docs check (README length, links, paths: scripts/check-docs.sh)"
scripts/check-docs.sh

step "layout check (capi without CLI tooling, header macros, import cycles: scripts/check-house.sh)"
scripts/check-house.sh

step "demo model (downloaded once into the cache, verified by size and sha256)"
TBOOST_DEMO_MODEL="$(scripts/fetch-demo-model.sh)"
export TBOOST_DEMO_MODEL

step "llama.cpp tokenizer suite (models/ggml-vocab-*, from the llama-cpp-python sdist, cached)"
TBOOST_LLAMA_VOCAB="$(scripts/fetch-llama-vocab.sh)"
export TBOOST_LLAMA_VOCAB

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
