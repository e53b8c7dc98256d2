#!/usr/bin/env bash
# The layout's promises, checked (issue "House in order"):
#   - the C ABI crate's normal dependencies carry no CLI tooling (clap, indicatif, env_logger);
#   - every #define in include/tboost.h is TBOOST_-prefixed (the include guard included);
#   - no import cycle between modules of different folders (scripts/check-layering.py).
# Usage: scripts/check-house.sh     exit 0 when all hold, 1 otherwise
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
bad() { echo "check-house: $*" >&2; fail=1; }

tree=$(cargo tree -p tboost-capi -e normal --prefix none --offline 2>/dev/null || cargo tree -p tboost-capi -e normal --prefix none)
for tool in clap indicatif env_logger; do
  if grep -q "^$tool v" <<<"$tree"; then
    bad "tboost-capi depends on $tool (cargo tree -p tboost-capi -e normal -i $tool shows the path)"
  fi
done

leaks=$(grep -E '^[[:space:]]*#[[:space:]]*define[[:space:]]+' include/tboost.h | awk '{print $2}' | sed 's/(.*//' | grep -v '^TBOOST_' || true)
[ -z "$leaks" ] || bad "include/tboost.h defines unprefixed macros: $(echo $leaks)"

python3 scripts/check-layering.py || fail=1

[ "$fail" = 0 ] && echo "check-house: capi without CLI tooling, header macros prefixed, no cross-folder import cycle"
exit "$fail"
