#!/usr/bin/env bash
# The cost of tensor parallelism on this machine: the same model and threads as
#   tp1   one process, one rank, T threads
#   local one process, tp = 2 over the `local` communicator, T threads shared
#   mpi   mpirun -np 2, one rank per process, T/2 threads each (comm mpi)
# alternated for --runs rounds; prints each run and the medians with their ratio to tp1.
#   scripts/bench-tp.sh [--model FILE] [--runs 3] [--threads 2] [--prefill 128] [--decode 64]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL="" RUNS=3 THREADS=2 PREFILL=128 DECODE=64
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --prefill) PREFILL=$2; shift 2 ;;
    --decode) DECODE=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$MODEL" ] || MODEL=$("$ROOT/scripts/fetch-demo-model.sh")
[ "$THREADS" -ge 2 ] || { echo "--threads must be at least 2 (one per rank under mpirun)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "mpirun is missing: run scripts/setup.sh" >&2; exit 1; }
cargo build --release -q -p tboost-cli
TBOOST=${CARGO_TARGET_DIR:-$ROOT/target}/release/tboost
export OMPI_MCA_btl_vader_single_copy_mechanism=none RUST_LOG=warn
BENCH=(bench --model "$MODEL" --prefill "$PREFILL" --decode "$DECODE" --repeat 3 --json)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# The leader's JSON line (under mpirun, the line --tag-output marks as rank 0's).
one() { # NAME COMMAND...
  local name=$1; shift
  "$@" >"$OUT/run.txt" 2>"$OUT/err.txt" || { cat "$OUT/err.txt" >&2; echo "$name failed" >&2; exit 1; }
  sed -n 's/^\[1,0\]<stdout>://p; /^{/p' "$OUT/run.txt" | grep -m1 '^{' | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["prefill_tokens_per_s"], d["decode_tokens_per_s"], d["backend"].replace(" ", "_"))' \
    >>"$OUT/$name"
  echo "$name $(tail -n1 "$OUT/$name")"
}
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), threads $THREADS; $(uptime)"
for r in $(seq "$RUNS"); do
  one tp1 "$TBOOST" "${BENCH[@]}" --threads "$THREADS"
  one local "$TBOOST" "${BENCH[@]}" --threads "$THREADS" --tp 2
  one mpi mpirun --allow-run-as-root --oversubscribe -np 2 --tag-output \
    "$TBOOST" "${BENCH[@]}" --threads $((THREADS / 2)) --comm mpi
done
python3 - "$OUT" <<'EOF'
import statistics, sys
d = sys.argv[1]
med, kernels = {}, {}
for name in ("tp1", "local", "mpi"):
    rows = [tuple(map(float, l.split()[:2])) for l in open(f"{d}/{name}")]
    kernels[name] = open(f"{d}/{name}").readline().split()[2].replace("_", " ")
    med[name] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
print("config  prefill t/s  decode t/s  (ratio to tp1)")
for name, (p, t) in med.items():
    print(f"{name:6}  {p:10.1f}  {t:10.2f}  ({p / med['tp1'][0]:.2f}x, {t / med['tp1'][1]:.2f}x)  {kernels[name]}")
EOF
