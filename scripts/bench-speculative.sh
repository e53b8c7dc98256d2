#!/usr/bin/env bash
# Speculative decoding on the demo model with the request prompt lookup (engine key
# spec_ngram) is made for: a chat asking to rewrite a function given in the prompt, greedy.
# With --draft-model FILE, a draft model (spec_draft_model, --draft tokens a step) instead,
# on --model (default the demo model; a model without a tokenizer gets a prompt of token ids).
# Runs `tboost run --json` alternately without and with speculation (A B A B ...), checks the
# two give the same tokens, and prints each run's decode tokens/s, the median ratio and the
# share of drafted tokens the model kept. A benchmark, not a test: run it on an idle machine.
#
#   scripts/bench-speculative.sh [--runs 3] [--draft 8] [--tokens 200] [--threads 2]
#                                [--model FILE] [--draft-model FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=3 DRAFT=8 TOKENS=200 THREADS=2 MODEL="" DRAFT_MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --draft-model) DRAFT_MODEL="$2"; shift 2 ;;
    --runs) RUNS="$2"; shift 2 ;;
    --draft) DRAFT="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-speculative: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$MODEL" ] || MODEL="${TBOOST_DEMO_MODEL:-$(scripts/fetch-demo-model.sh)}"
[ -x target/release/tboost ] || cargo build --release -p tboost-cli >&2
read -r -d '' ASK <<'TXT' || true
Rename the variable `total` to `running_sum` in this function and return the whole function:

def summarize(values, weights=None):
    total = 0.0
    count = 0
    for i, v in enumerate(values):
        w = 1.0 if weights is None else weights[i]
        if v is None:
            continue
        total += w * v
        count += 1
    if count == 0:
        return {"total": 0.0, "count": 0, "mean": None}
    mean = total / count
    return {"total": total, "count": count, "mean": mean}
TXT
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
if target/release/tboost tokenize --model "$MODEL" --text x >/dev/null 2>&1; then
  PROMPT=(--chat "$ASK")
else
  # No tokenizer (a synthetic model): token ids, and no end of sequence to stop at.
  PROMPT=(--tokens "$(python3 -c 'print(",".join(str(3 + (j * 37) % 997) for j in range(48)))')" --ignore-eos)
fi
for r in $(seq 1 "$RUNS"); do
  for k in 0 "$DRAFT"; do
    if [ "$k" = 0 ]; then SPEC=(--set spec_ngram=0)
    elif [ -n "$DRAFT_MODEL" ]; then SPEC=(--set "spec_draft_model=$DRAFT_MODEL" --set "spec_draft_tokens=$k")
    else SPEC=(--set "spec_ngram=$k"); fi
    target/release/tboost run --model "$MODEL" "${PROMPT[@]}" --temp 0 -n "$TOKENS" --threads "$THREADS" \
      "${SPEC[@]}" --json >"$OUT/run-$r-$k.json"
  done
done
python3 - "$OUT" "$RUNS" "$DRAFT" "$MODEL" "$DRAFT_MODEL" <<'PY'
import json, os, statistics, sys
out, runs, draft, model, draft_model = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
load = lambda r, k: json.load(open(os.path.join(out, f"run-{r}-{k}.json")))
base = [load(r, 0) for r in range(1, runs + 1)]
spec = [load(r, draft) for r in range(1, runs + 1)]
for b, s in zip(base, spec):
    if b["generated_ids"] != s["generated_ids"]:
        sys.exit("bench-speculative: speculative decoding changed the greedy tokens")
tb = [b["decode_tokens_per_s"] for b in base]
ts = [s["decode_tokens_per_s"] for s in spec]
drafted = sum(s.get("spec_drafted", 0) for s in spec)
kept = sum(s.get("spec_accepted", 0) for s in spec)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
how = f"draft model {os.path.basename(draft_model)}, spec_draft_tokens={draft}" if draft_model else f"spec_ngram={draft}"
print(f"{os.path.basename(model)}, {len(base[0]['generated_ids'])} greedy tokens, {cpu}")
print(f"decode tokens/s without speculation: {', '.join(f'{x:.1f}' for x in tb)} (median {statistics.median(tb):.1f})")
print(f"decode tokens/s with {how}: {', '.join(f'{x:.1f}' for x in ts)} (median {statistics.median(ts):.1f})")
print(f"ratio {statistics.median(ts) / statistics.median(tb):.2f}x; drafted tokens kept: {kept} of {drafted} ({100 * kept / max(drafted, 1):.0f}%); identical tokens: yes")
PY
