#!/usr/bin/env bash
# Soak test of the C ABI (not part of scripts/test.sh: it takes minutes). 10,000 requests
# from 8 threads with random priorities, sampling, stop sequences and cancels, while one
# thread steps, in a C++ host built with AddressSanitizer and linked with the static
# library; LeakSanitizer checks for leaks at exit. The program asserts one finish event per
# request, the header's cancel contract, an empty KV cache at the end and flat RSS, and
# prints what it counted (crates/capi/tests/soak/soak.cpp).
#
# Usage: scripts/soak.sh [MODEL] [REQUESTS] [THREADS] [SEED]
#   MODEL defaults to the golden llama_gqa checkpoint in ../shared (or $TBOOST_SHARED).
#   TBOOST_SOAK_RSS_GROWTH_MB (default 32): the RSS growth allowed from 10% to 100%.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED=${TBOOST_SHARED:-$ROOT/../shared}
MODEL=${1:-$SHARED/testdata/golden/llama_gqa}
REQUESTS=${2:-10000}
THREADS=${3:-8}
SEED=${4:-1}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
BUILD=$TARGET_DIR/soak
export TBOOST_SHARED=$SHARED

[ -e "$MODEL" ] || {
  echo "soak: model $MODEL not found: put \`shared\` next to the repository or set TBOOST_SHARED" >&2
  exit 1
}
"$ROOT/scripts/setup.sh"
export PATH="${CARGO_HOME:-${HOME:-$(echo ~)}/.cargo}/bin:$PATH"

echo "soak: building (cargo release library + ASan host) in $BUILD"
cmake -S "$ROOT/crates/capi/tests/soak" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTBOOST_CARGO_TARGET_DIR="$TARGET_DIR" >/dev/null
cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)"
symbols=$(nm "$BUILD/tboost_soak")
[[ "$symbols" == *__asan_init* ]] || { echo "soak: the host is not instrumented with ASan" >&2; exit 1; }

# A small quarantine: ASan keeps freed memory back (256 MiB by default), which would read as
# RSS growth.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:quarantine_size_mb=8:malloc_context_size=30}
# LeakSanitizer must be live: a deliberate leak is reported (and fails that run).
if "$BUILD/tboost_soak" --leak-self-test 2>"$BUILD/leak-self-test.log"; then
  echo "soak: LeakSanitizer did not report a deliberate leak: leaks would go unnoticed" >&2
  exit 1
fi
grep -q "LeakSanitizer: detected memory leaks" "$BUILD/leak-self-test.log" ||
  { cat "$BUILD/leak-self-test.log" >&2; echo "soak: the leak self-test failed in another way" >&2; exit 1; }
echo "soak: LeakSanitizer is live (it reported the self-test's deliberate leak)"
echo "soak: $REQUESTS requests, $THREADS threads, model $MODEL, ASAN_OPTIONS=$ASAN_OPTIONS"
"$BUILD/tboost_soak" "$MODEL" "$REQUESTS" "$THREADS" "$SEED"
echo "soak: passed (no leaks reported by LeakSanitizer)"
