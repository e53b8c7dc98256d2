#!/usr/bin/env bash
# Regenerates ascend-sys/src/raw.rs from ascend-sys/include/tboost_cann.h with a pinned bindgen.
#   scripts/gen-ascend-bindings.sh           rewrite raw.rs
#   scripts/gen-ascend-bindings.sh --check   fail if the checked-in raw.rs differs (the drift check)
# Needs: cargo install --locked bindgen-cli --version 0.72.1 ; apt-get install libclang-dev
# The flags below are part of the pin: prettyplease formatting (no rustfmt dependence), no doc comments
# (no libclang-version dependence), only the header's own acl*/aclnn*/GMM*/Hccl*/tboost* items.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BINDGEN_VERSION=0.72.1
HEADER=ascend-sys/include/tboost_cann.h
OUT=ascend-sys/src/raw.rs

command -v bindgen >/dev/null ||
  { echo "gen-ascend-bindings: bindgen is missing: cargo install --locked bindgen-cli --version $BINDGEN_VERSION (and apt-get install libclang-dev)" >&2; exit 1; }
have=$(bindgen --version | awk '{print $2}')
[ "$have" = "$BINDGEN_VERSION" ] ||
  { echo "gen-ascend-bindings: bindgen $have found, $BINDGEN_VERSION required: cargo install --locked bindgen-cli --version $BINDGEN_VERSION" >&2; exit 1; }

generate() {
  (cd "$ROOT" && bindgen "$HEADER" \
    --rust-target 1.82 --rust-edition 2021 \
    --formatter prettyplease --no-doc-comments \
    --allowlist-type '(acl|aclnn|aclrt|tboost|GMM|Hccl)[A-Za-z0-9_]*' \
    --allowlist-var '(ACL|ACLNN|GMM|HCCL)_[A-Za-z0-9_]*' \
    --default-enum-style consts \
    -- -x c -std=c11)
}

if [ "${1:-}" = "--check" ]; then
  tmp=$(mktemp)
  trap 'rm -f "$tmp"' EXIT
  generate >"$tmp"
  if ! diff -u "$ROOT/$OUT" "$tmp"; then
    echo "gen-ascend-bindings: $OUT differs from what bindgen $BINDGEN_VERSION generates from $HEADER:" >&2
    echo "  run scripts/gen-ascend-bindings.sh and commit $OUT" >&2
    exit 1
  fi
  echo "gen-ascend-bindings: $OUT is up to date with $HEADER"
else
  generate >"$ROOT/$OUT"
  echo "gen-ascend-bindings: wrote $OUT"
fi
