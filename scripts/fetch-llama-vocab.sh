#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer suite (models/ggml-vocab-*.gguf with their .inp/.out cases) into
# the tboost cache, for the tests that run it through `tboost tokenize` and the C ABI.
#
# The files ship in llama.cpp's source, which the Python package index distributes inside the
# llama-cpp-python sdist (vendor/llama.cpp/models/). The sdist is checked by sha256, only the
# ggml-vocab-* members are unpacked, and the directory is filled under a temporary name and
# renamed, so a crash never leaves a directory that looks complete.
#
# Usage: scripts/fetch-llama-vocab.sh [DEST_DIR]
#   DEST_DIR defaults to ${TBOOST_CACHE:-$HOME/.cache/tboost}/llama-vocab.
# Prints progress to stderr and the directory on stdout.
set -euo pipefail

PKG="llama-cpp-python==0.3.36"
SDIST="llama_cpp_python-0.3.36.tar.gz"
SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PREFIX="llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
# The suite's vocabularies (llama.cpp tests/CMakeLists.txt, test-tokenizer-0): each needs its
# .gguf, .gguf.inp and .gguf.out.
VOCABS="bert-bge command-r deepseek-coder deepseek-llm falcon gemma-4 gpt-2 llama-bpe llama-spm mpt phi-3 qwen2 qwen35 refact starcoder"

die() {
    echo "fetch-llama-vocab: error: $*" >&2
    exit 1
}
say() { echo "fetch-llama-vocab: $*" >&2; }

DEST="${1:-${TBOOST_CACHE:-$HOME/.cache/tboost}/llama-vocab}"

complete() {
    local v
    for v in $VOCABS; do
        for ext in gguf gguf.inp gguf.out; do
            [ -s "$1/ggml-vocab-$v.$ext" ] || return 1
        done
    done
}

if complete "$DEST"; then
    say "already present: $DEST"
    echo "$DEST"
    exit 0
fi

command -v python3 >/dev/null || die "python3 is required (it runs pip and unpacks the sdist)"
command -v sha256sum >/dev/null || die "sha256sum is required to verify the download"

mkdir -p "$(dirname "$DEST")" || die "cannot create $(dirname "$DEST")"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/tboost-vocab.XXXXXX") || die "cannot create a temporary directory"
trap 'rm -rf "$TMP"' EXIT

say "downloading $PKG (source distribution, ~77 MB)"
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python --no-cache-dir \
    --dest "$TMP" "$PKG" >&2 || die "pip could not download $PKG (is the Python package index reachable?)"
[ -f "$TMP/$SDIST" ] || die "pip did not produce $SDIST"
digest=$(sha256sum "$TMP/$SDIST" | cut -d' ' -f1)
[ "$digest" = "$SHA256" ] || die "$SDIST: sha256 $digest, expected $SHA256"

say "unpacking ${PREFIX}ggml-vocab-*"
python3 - "$TMP/$SDIST" "$PREFIX" "$TMP/out" <<'PY' || die "could not unpack the vocabularies"
import os, shutil, sys, tarfile
sdist, prefix, out = sys.argv[1:4]
os.makedirs(out)
n = 0
with tarfile.open(sdist) as t:
    for m in t.getmembers():
        name = m.name[len(prefix):] if m.name.startswith(prefix) else None
        if not name or "/" in name or not name.startswith("ggml-vocab-") or not m.isfile():
            continue
        with t.extractfile(m) as src, open(os.path.join(out, name), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        n += 1
if n == 0:
    sys.exit(f"{sdist} has no {prefix}ggml-vocab-* files")
PY
missing=""
for v in $VOCABS; do
    for ext in gguf gguf.inp gguf.out; do
        [ -s "$TMP/out/ggml-vocab-$v.$ext" ] || missing="$missing ggml-vocab-$v.$ext"
    done
done
[ -z "$missing" ] || die "$SDIST lacks:$missing"

rm -rf "$DEST"
mv "$TMP/out" "$DEST" || die "cannot move the suite into $DEST"
say "installed $DEST"
echo "$DEST"
