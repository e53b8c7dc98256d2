#!/usr/bin/env bash
# Greedy ids of tboost against llama.cpp's on the same GGUF files: the demo model's 4 prompts
# (../shared/models/qwen-demo-golden.json) × 32 tokens, the token ids fed to both engines, and
# every step's argmax (llama.cpp through its C API, a 40-line program compiled here against
# the llama.cpp build; tboost through `tboost run --temp 0`, precision auto = fast, which
# quantizes activations to 8 bits as llama.cpp's CPU dot products do).
#
#   scripts/compare-greedy-llamacpp.sh --llama-cpp DIR [--requantize TYPES] [MODEL.gguf ...]
#
#   --llama-cpp DIR     a llama.cpp source tree built with CMake in DIR/build (libllama.so and,
#                       for --requantize, llama-quantize). The llama.cpp that llama-cpp-python
#                       0.3.36 vendors: `pip download --no-deps --no-binary llama-cpp-python
#                       llama-cpp-python==0.3.36`, unpack, `cmake -B build -DGGML_NATIVE=ON
#                       -DLLAMA_CURL=OFF && cmake --build build --target llama-quantize llama-simple`
#   --requantize TYPES  also write the demo model requantized by llama-quantize
#                       (--allow-requantize) to each of TYPES (comma-separated, e.g.
#                       Q4_1,Q3_K_M,Q2_K) into the cache directory and compare those
#   --tokens N          tokens per prompt (default 32)
# Without MODEL arguments: the demo model (scripts/fetch-demo-model.sh).
# Prints, per file and prompt, the ids that agree before the first difference, judged by the
# rule of qwen-demo-golden.json for 8-bit activations (a difference passes only at a near tie:
# llama.cpp's top-2 margin below 0.35 and tboost's id its second best); exits 1 on a failure.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED=${TBOOST_SHARED:-$ROOT/../shared}
CACHE=${TBOOST_BENCH_CACHE:-$HOME/.cache/tboost/bench}
LLAMA_CPP="" TYPES="" N=32 MODELS=()
die() { echo "compare-greedy-llamacpp: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-cpp) LLAMA_CPP=$2; shift 2 ;;
    --requantize) TYPES=$2; shift 2 ;;
    --tokens) N=$2; shift 2 ;;
    -*) die "unknown option $1" ;;
    *) MODELS+=("$1"); shift ;;
  esac
done
[ -n "$LLAMA_CPP" ] || die "--llama-cpp DIR is required (see the header of this script)"
LIB=$LLAMA_CPP/build/bin
[ -f "$LIB/libllama.so" ] || die "$LIB/libllama.so is missing: build llama.cpp in $LLAMA_CPP/build"
GOLDEN=$SHARED/models/qwen-demo-golden.json
[ -f "$GOLDEN" ] || die "$GOLDEN is missing (the shared test data)"
DEMO=${TBOOST_DEMO_MODEL:-$("$ROOT/scripts/fetch-demo-model.sh")}
[ ${#MODELS[@]} -gt 0 ] || MODELS=("$DEMO")
if [ -n "$TYPES" ]; then
  mkdir -p "$CACHE"
  for t in ${TYPES//,/ }; do
    out=$CACHE/$(basename "$DEMO" .gguf)-requant-$t.gguf
    [ -f "$out" ] || "$LIB/llama-quantize" --allow-requantize "$DEMO" "$out" "$t" >"$out.log" 2>&1 ||
      die "llama-quantize to $t failed (log: $out.log)"
    MODELS+=("$out")
  done
fi
cargo build --release -q -p tboost-cli
TBOOST=${CARGO_TARGET_DIR:-$ROOT/target}/release/tboost
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat >"$WORK/greedy.c" <<'EOF'
// llama.cpp's greedy ids after a prompt of token ids: greedy MODEL N ID,ID,...
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    if (argc < 4) return 2;
    int n = atoi(argv[2]), np = 0;
    llama_token prompt[4096], tok;
    for (char *p = strtok(argv[3], ","); p && np < 4096; p = strtok(NULL, ",")) prompt[np++] = atoi(p);
    llama_backend_init();
    struct llama_model *m = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!m) return 1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024, cp.n_batch = 1024, cp.n_threads = 2, cp.n_threads_batch = 2;
    struct llama_context *ctx = llama_init_from_model(m, cp);
    int nv = llama_vocab_n_tokens(llama_model_get_vocab(m));
    struct llama_batch b = llama_batch_get_one(prompt, np);
    for (int i = 0; i < n; i++) {
        if (llama_decode(ctx, b)) return 1;
        const float *lg = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int j = 1; j < nv; j++) if (lg[j] > lg[best]) best = j;  /* first of equal values */
        int second = best == 0 ? 1 : 0;
        for (int j = 0; j < nv; j++) if (j != best && lg[j] > lg[second]) second = j;
        tok = best;
        printf("%s%d:%d:%.5f", i ? "," : "", tok, second, lg[best] - lg[second]);
        b = llama_batch_get_one(&tok, 1);
    }
    printf("\n");
    return 0;
}
EOF
cc -O2 -o "$WORK/greedy" "$WORK/greedy.c" -I"$LLAMA_CPP/include" -I"$LLAMA_CPP/ggml/include" -L"$LIB" -lllama \
  -Wl,-rpath,"$LIB" || die "compiling the llama.cpp probe failed"
mapfile -t PROMPTS < <(python3 -c 'import json,sys; [print(",".join(map(str, p["prompt_ids"]))) for p in json.load(open(sys.argv[1]))["prompts"]]' "$GOLDEN")
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs); llama.cpp: $LLAMA_CPP"
bad=0
for m in "${MODELS[@]}"; do
  types=$(python3 - "$m" <<'PY'
import collections, struct, sys
# GGUF header: the tensor types of the file, counted (llama-quantize mixes types per tensor).
names = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
         12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16"}
f = open(sys.argv[1], "rb")
f.read(4); struct.unpack("<I", f.read(4)); nt, nkv = struct.unpack("<QQ", f.read(16))
def s(): n, = struct.unpack("<Q", f.read(8)); return f.read(n)
sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def val(t):
    if t == 8: s()
    elif t == 9:
        et, n = struct.unpack("<IQ", f.read(12))
        for _ in range(n): val(et)
    else: f.read(sizes[t])
for _ in range(nkv):
    s(); t, = struct.unpack("<I", f.read(4)); val(t)
c = collections.Counter()
for _ in range(nt):
    s(); nd, = struct.unpack("<I", f.read(4)); f.read(8 * nd); t, = struct.unpack("<I", f.read(4)); f.read(8)
    c[names.get(t, str(t))] += 1
print(" ".join(f"{k}x{v}" for k, v in c.most_common()))
PY
)
  echo "== $(basename "$m") (tensors: $types)"
  for i in "${!PROMPTS[@]}"; do
    p=${PROMPTS[$i]}
    want=$("$WORK/greedy" "$m" "$N" "$p" 2>/dev/null) || die "llama.cpp failed on $m"
    got=$("$TBOOST" run --model "$m" --tokens "$p" -n "$N" --temp 0 --ignore-eos --json --threads 2 2>/dev/null |
      python3 -c 'import json,sys; print(",".join(map(str, json.loads([l for l in sys.stdin if l.startswith("{")][-1])["generated_ids"])))')
    # The rule of qwen-demo-golden.json for engines with 8-bit activations: at the first step
    # that differs, pass (and compare no further) only if llama.cpp's top-2 margin there is
    # below TAU = 0.35 and tboost took llama.cpp's second-best id.
    verdict=$(python3 - "$want" "$got" "$N" <<'PY'
import sys
steps = [s.split(":") for s in sys.argv[1].split(",")]
want = [int(s[0]) for s in steps]
got = [int(x) for x in sys.argv[2].split(",")]
n = 0
while n < min(len(want), len(got)) and want[n] == got[n]:
    n += 1
if n == int(sys.argv[3]):
    print(f"ok {n}/{n} ids equal")
else:
    second, margin = int(steps[n][1]), float(steps[n][2])
    ok = margin < 0.35 and got[n] == second
    print(f"{'ok' if ok else 'FAIL'} first {n} equal; at step {n} llama.cpp {want[n]} over {second} by {margin:.4f}, "
          f"tboost {got[n]}{' (its second best, a near tie)' if ok else ''}")
PY
)
    echo "prompt $i: ${verdict#* }"
    [[ $verdict == ok* ]] || bad=1
  done
done
exit $bad
