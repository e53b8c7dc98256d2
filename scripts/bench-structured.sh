#!/usr/bin/env bash
# Structured output under load, on the demo model: N sampled requests in one batch (`tboost
# batch`), half of them held to a JSON schema, the other half free; run alternately against
# the same N requests with no grammar at all (A B A B ...). Prints, per run, the mean step
# time and the host time spent on grammar masks per step, the ratio of the step times, and
# checks that every constrained output parses as JSON and validates against the schema.
# A benchmark, not a test: run it on an idle machine.
#
#   scripts/bench-structured.sh [--requests 100] [--runs 3] [--tokens 48] [--threads 2]
set -euo pipefail
cd "$(dirname "$0")/.."
N=100 RUNS=3 TOKENS=48 THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) N="$2"; shift 2 ;;
    --runs) RUNS="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-structured: unknown option $1" >&2; exit 2 ;;
  esac
done
MODEL="${TBOOST_DEMO_MODEL:-$(scripts/fetch-demo-model.sh)}"
[ -x target/release/tboost ] || cargo build --release -p tboost-cli >&2
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
chat() { printf '<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$1"; }
target/release/tboost tokenize --model "$MODEL" --no-special --json \
  --text "$(chat 'Describe a fictional person as JSON with a name, an age and up to three color tags.')" \
  --text "$(chat 'Write two sentences about the sea.')" >"$OUT/prompts.jsonl"
python3 - "$OUT" "$N" "$TOKENS" <<'PY'
import json, sys
out, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
person, free = [json.loads(l)["ids"] for l in open(f"{out}/prompts.jsonl")]
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 150},
          "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
json.dump(schema, open(f"{out}/schema.json", "w"))
with open(f"{out}/with.jsonl", "w") as w, open(f"{out}/without.jsonl", "w") as wo:
    for i in range(n):
        line = {"tokens": person if i % 2 == 0 else free, "max_tokens": tokens, "temperature": 0.9,
                "top_p": 0.95, "seed": 1000 + i}
        wo.write(json.dumps(line) + "\n")
        if i % 2 == 0:
            line = dict(line, grammar={"json_schema": json.dumps(schema)})
        w.write(json.dumps(line) + "\n")
PY
for r in $(seq 1 "$RUNS"); do
  for kind in without with; do
    target/release/tboost batch --model "$MODEL" --requests "$OUT/$kind.jsonl" --threads "$THREADS" \
      --max-seqs "$N" --max-batched-tokens 2048 --kv-blocks 4096 >"$OUT/$kind-$r.jsonl"
  done
done
python3 - "$OUT" "$RUNS" "$N" <<'PY'
import json, statistics, sys
out, runs, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
schema = json.load(open(f"{out}/schema.json"))
def valid(v):
    return (isinstance(v, dict) and sorted(v) == ["age", "name", "tags"] and isinstance(v["name"], str)
            and len(v["name"]) <= 20 and isinstance(v["age"], int) and 0 <= v["age"] <= 150
            and isinstance(v["tags"], list) and len(v["tags"]) <= 3
            and all(t in ("red", "green", "blue") for t in v["tags"]))
def run(kind, r):
    lines = [json.loads(l) for l in open(f"{out}/{kind}-{r}.jsonl")]
    return [l for l in lines if "index" in l], lines[-1]["stats"]
step = {"with": [], "without": []}
per_token = {"with": [], "without": []}
bad = 0
for r in range(1, runs + 1):
    for kind in ("without", "with"):
        results, st = run(kind, r)
        ms = st["total_step_ms"] / st["steps"]
        step[kind].append(ms)
        per_token[kind].append(st["total_step_ms"] / st["generated_tokens"])
        masks = st.get("grammar_masks", 0)
        mask_ms = st.get("grammar_mask_ms", 0.0)
        print(f"run {r} {kind:>7} grammar: {st['steps']} steps, {ms:.1f} ms per step, "
              f"{st['total_step_ms'] / st['generated_tokens']:.2f} ms per generated token, "
              f"{masks} masks, {mask_ms / max(st['steps'], 1):.2f} ms of mask time per step "
              f"({mask_ms / max(masks, 1):.3f} ms each, overlapping the forward pass)")
        if kind == "with":
            for res in results:
                if res["index"] % 2 == 0:
                    try:
                        ok = res["finish_reason"] == "eos" and valid(json.loads(res["text"]))
                    except Exception:
                        ok = False
                    bad += not ok
ratio = statistics.median(step["with"]) / statistics.median(step["without"])
tok_ratio = statistics.median(per_token["with"]) / statistics.median(per_token["without"])
print(f"{n} requests ({n // 2 + n % 2} with a JSON schema): median step time with grammars / without = {ratio:.3f}; "
      f"per generated token {tok_ratio:.3f} (constrained requests end when their JSON does, so later steps are smaller)")
print(f"constrained outputs that failed to parse or validate: {bad} of {runs * (n // 2 + n % 2)}")
sys.exit(1 if bad else 0)
PY
