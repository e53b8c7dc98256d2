#!/usr/bin/env bash
# Builds the CANN SIMULATOR (ascend-sim/, not CANN) into target/ascend-sim/<variant>/lib64/ and prints
# exactly one line on stdout: the directory to use as ASCEND_HOME_PATH. Incremental: a variant is rebuilt
# only when its sources, this script or its flags change. Safe to run concurrently (flock).
#
#   scripts/build-ascend-sim.sh                          the full simulator (variant "default"), libhccl.so included
#   scripts/build-ascend-sim.sh --omit aclnnSwiGlu,...   a variant whose libraries do not export these symbols
#                                                        (an op name hides both aclnnX and aclnnXGetWorkspaceSize)
#   scripts/build-ascend-sim.sh --split                  transformer ops in libopapi_transformer.so instead of
#                                                        libopapi.so (the split layout of newer CANN)
# Needs gcc. Compiled as C11 with -Wall -Wextra -Werror against ascend-sys/include/tboost_cann.h.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
SRC=$ROOT/ascend-sim/src
HEADER_DIR=$ROOT/ascend-sys/include
CC=${CC:-gcc}

omit=""
split=0
while [ $# -gt 0 ]; do
  case "$1" in
    --omit) omit=${2:?--omit needs a comma-separated list of symbols}; shift 2 ;;
    --omit=*) omit=${1#--omit=}; shift ;;
    --split) split=1; shift ;;
    *) echo "build-ascend-sim: unknown argument '$1' (use --omit a,b,c and/or --split)" >&2; exit 2 ;;
  esac
done
command -v "$CC" >/dev/null || { echo "build-ascend-sim: $CC is missing: apt-get install gcc" >&2; exit 1; }

omit_sorted=$(printf '%s' "$omit" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
variant=default
if [ "$split" = 1 ] && [ -n "$omit_sorted" ]; then
  variant=split-omit-$(printf '%s' "$omit_sorted" | sha256sum | cut -c1-12)
elif [ "$split" = 1 ]; then
  variant=split
elif [ -n "$omit_sorted" ]; then
  variant=omit-$(printf '%s' "$omit_sorted" | sha256sum | cut -c1-12)
fi
OUT=$TARGET_DIR/ascend-sim/$variant
LIB=$OUT/lib64
OBJ=$TARGET_DIR/ascend-sim/obj
mkdir -p "$LIB" "$OBJ"

exec 9>"$TARGET_DIR/ascend-sim/.lock"
flock 9

CFLAGS=(-std=c11 -O2 -g -fPIC -Wall -Wextra -Werror -I"$HEADER_DIR" -I"$SRC")
# objects are shared by all variants (they differ only in what the link exports)
obj_stamp=$( { cat "$SRC"/*.c "$SRC"/*.h "$HEADER_DIR/tboost_cann.h"; echo "${CFLAGS[*]}"; "$CC" --version | head -1; } |
  sha256sum | cut -c1-64)
stamp=$( { echo "$obj_stamp"; cat "${BASH_SOURCE[0]}"; echo "omit=$omit_sorted split=$split"; } | sha256sum | cut -c1-64)
if [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$stamp" ] && [ -f "$LIB/libascendcl.so" ]; then
  echo "$OUT"
  exit 0
fi
rm -f "$OUT/.stamp" "$LIB"/*.so

# Exports: the CANN names plus the sim-only tboostSim* names; omitted symbols are made local.
local_syms=""
for s in $(printf '%s' "$omit_sorted" | tr ',' ' '); do
  case "$s" in
    aclnn*GetWorkspaceSize) local_syms="$local_syms $s; ${s%GetWorkspaceSize};" ;;
    aclnn*) local_syms="$local_syms $s; ${s}GetWorkspaceSize;" ;;
    *) local_syms="$local_syms $s;" ;;
  esac
done
printf '{\n  global: acl*; Hccl*; tboostSim*;\n  local: %s *;\n};\n' "$local_syms" >"$OUT/exports.map"

cc_obj() { "$CC" "${CFLAGS[@]}" -c "$SRC/$1.c" -o "$OBJ/$1.o" >&2; }
link() { # name soname objs... -- libs...
  local name=$1; shift
  "$CC" -shared -o "$LIB/$name" -Wl,-soname,"$name" -Wl,--version-script="$OUT/exports.map" \
    -Wl,-rpath,'$ORIGIN' -Wl,--no-undefined "$@" >&2
}
if [ ! -f "$OBJ/.stamp" ] || [ "$(cat "$OBJ/.stamp")" != "$obj_stamp" ]; then
  rm -f "$OBJ/.stamp"
  for f in core nnopbase ops_nn ops_math ops_attention ops_moe ops_mc2 hccl hccl_shm; do cc_obj "$f"; done
  echo "$obj_stamp" >"$OBJ/.stamp"
fi
link libascendcl.so "$OBJ/core.o" -lpthread -lm
link libnnopbase.so "$OBJ/nnopbase.o" -L"$LIB" -lascendcl
if [ "$split" = 1 ]; then
  link libopapi.so "$OBJ/ops_nn.o" "$OBJ/ops_math.o" -L"$LIB" -lnnopbase -lascendcl -lm
  link libopapi_transformer.so "$OBJ/ops_attention.o" "$OBJ/ops_moe.o" "$OBJ/ops_mc2.o" -L"$LIB" -lnnopbase -lascendcl -lm -ldl -lpthread
else
  link libopapi.so "$OBJ/ops_nn.o" "$OBJ/ops_math.o" "$OBJ/ops_attention.o" "$OBJ/ops_moe.o" "$OBJ/ops_mc2.o" \
    -L"$LIB" -lnnopbase -lascendcl -lm -ldl -lpthread
fi
link libhccl.so "$OBJ/hccl.o" "$OBJ/hccl_shm.o" -L"$LIB" -lascendcl -lpthread -lm -lrt
cat >"$OUT/VARIANT" <<INFO
CANN SIMULATOR (ascend-sim), not CANN. Variant: $variant
omitted symbols: ${omit_sorted:-none}
transformer ops in: $([ "$split" = 1 ] && echo libopapi_transformer.so || echo libopapi.so)
INFO
echo "$stamp" >"$OUT/.stamp"
echo "$OUT"
