#!/usr/bin/env bash
# The golden checks with --backend ascend on a machine with real CANN and an Ascend NPU: every case of
# ../shared/testdata/golden through `tboost logits` (last and all positions) and `tboost run` (greedy ids),
# with the f16 tolerance the simulator tests use (tests/ascend.rs):
#   TOL = 2·sqrt(12·layers + 4)·2^-11·max|want|, greedy ids under the golden README's margin rule with 2·TOL.
# It prints the plan (the aclnn op per slot, the SoC and the CANN version) first.
#
#   scripts/ascend-smoke.sh [--device N] [--allow-simulator]
#
# CANN is found as tboost finds it (ASCEND_HOME_PATH, ASCEND_TOOLKIT_HOME, LD_LIBRARY_PATH, then
# /usr/local/Ascend/ascend-toolkit/latest): source CANN's set_env.sh first. The script REFUSES to run
# against the CANN SIMULATOR (ascend-sim), which `scripts/test.sh` already covers; --allow-simulator runs
# it there anyway, saying so on every line that matters (useful to check the script itself).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHARED=${TBOOST_SHARED:-$ROOT/../shared}
GOLDEN=$SHARED/testdata/golden
device=0
allow_sim=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:?--device needs a number}; shift 2 ;;
    --allow-simulator) allow_sim=1; shift ;;
    *) echo "ascend-smoke: unknown argument '$1' (use --device N, --allow-simulator)" >&2; exit 2 ;;
  esac
done
[ -d "$GOLDEN" ] || { echo "ascend-smoke: golden models not found at $GOLDEN (set TBOOST_SHARED)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "ascend-smoke: python3 is needed to compare the outputs" >&2; exit 1; }

echo "ascend-smoke: building tboost (release)..." >&2
(cd "$ROOT" && cargo build --release --bin tboost >&2)
TBOOST=$ROOT/target/release/tboost
BACKEND=ascend:$device

plan=$("$TBOOST" plan --json --backend "$BACKEND" --model "$GOLDEN/llama_gqa") || {
  echo "ascend-smoke: the Ascend backend does not open (see the error above): is CANN installed and its set_env.sh sourced?" >&2
  exit 1
}
device_text=$(printf '%s' "$plan" | python3 -c 'import json,sys; d=json.load(sys.stdin)["device"]; print(d["device"], "|", d.get("runtime_version"))')
LABEL="NPU"
if [[ "$device_text" == *SIMULATOR* ]]; then
  if [ "$allow_sim" != 1 ]; then
    echo "ascend-smoke: REFUSING: CANN resolves to the CANN SIMULATOR ($device_text)." >&2
    echo "  This script is for real CANN on an NPU; scripts/test.sh already runs these checks on the simulator." >&2
    echo "  Unset ASCEND_HOME_PATH (or point it at the toolkit), or pass --allow-simulator to run here anyway." >&2
    exit 2
  fi
  LABEL="CANN SIMULATOR (NOT AN NPU)"
  echo "######## ascend-smoke: RUNNING ON THE CANN SIMULATOR, NOT ON AN NPU (--allow-simulator) ########"
fi
echo "ascend-smoke: device: $device_text [$LABEL]"
for case in llama_gqa llama_hd24; do
  echo "--- plan of $case on $BACKEND [$LABEL]"
  RUST_LOG=info "$TBOOST" plan --backend "$BACKEND" --model "$GOLDEN/$case" 2>&1 >/dev/null | sed 's/^\[[A-Z]* *[a-z_:]*\] //'
done

python3 - "$TBOOST" "$BACKEND" "$GOLDEN" "$LABEL" <<'PY'
import json, math, subprocess, sys
tboost, backend, golden, label = sys.argv[1:5]
U = 2.0 ** -11
cases = ["llama_gqa", "llama_gqa_bf16", "llama_hd24", "mistral", "mixtral", "qwen2"]
failures = []

def tol(layers, want):
    return 2.0 * math.sqrt(12 * layers + 4) * U * max(abs(x) for x in want)

def run(args):
    r = subprocess.run([tboost] + args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"tboost {' '.join(args)} failed:\n{r.stderr}")
    return r.stdout

for case in cases:
    g = json.load(open(f"{golden}/{case}/golden.json"))
    layers = g["params"]["num_hidden_layers"]
    for p in g["prompts"]:
        ids = p["token_ids"]
        toks = ",".join(map(str, ids))
        rows = json.loads(run(["logits", "--backend", backend, "--model", f"{golden}/{case}", "--tokens", toks,
                               "--all-positions"]))["logits"]
        want = p["last_logits"]
        t = tol(layers, want)
        d = max(abs(a - b) for a, b in zip(rows[-1], want))
        ok = d <= t
        if p.get("all_logits"):
            wa = [x for r in p["all_logits"] for x in r]
            ta = tol(layers, wa)
            da = max(abs(a - b) for ra, rb in zip(rows, p["all_logits"]) for a, b in zip(ra, rb))
            ok = ok and da <= ta
        gr = p["greedy"]
        out = json.loads(run(["run", "--backend", backend, "--model", f"{golden}/{case}", "--tokens", toks,
                              "-n", str(len(gr["tokens_f64"])), "--temp", "0", "--ignore-eos", "--json"]))
        got, ref = out["generated_ids"], gr["tokens_f64"]
        tau = 2.0 * tol(layers, gr["steps"][0]["top5_logits"])
        greedy_ok = True
        for s, (a, b) in enumerate(zip(got, ref)):
            if a != b:
                st = gr["steps"][s]
                greedy_ok = st["top2_margin_f64"] <= tau and a == st["top5_ids"][1]
                break
        greedy_ok = greedy_ok and len(got) >= len(ref)
        verdict = "ok" if ok and greedy_ok else "FAIL"
        print(f"{verdict:4} {case}/{len(ids)} tokens: last_logits max abs diff {d:.2e} (tol {t:.2e}), "
              f"greedy {'ok' if greedy_ok else 'differs'} [{label}]")
        if verdict != "ok":
            failures.append(f"{case}/{len(ids)} tokens")
print(f"ascend-smoke: {len(failures)} failures [{label}]" + (": " + ", ".join(failures) if failures else ""))
sys.exit(1 if failures else 0)
PY
