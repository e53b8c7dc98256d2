#!/usr/bin/env bash
# tboost against llama.cpp on the same GGUF files, the same machine and the same threads:
# prefill (pp512) and decode (tg128, from an empty context as llama-bench's) per model, and
# aggregate decode of concurrent requests (llama-batched-bench -npp 32 -ntg 64 -npl 1,4,16
# against tboost bench --concurrency). Runs
# alternate A B A B so slow drift of a shared machine hits both engines alike; each figure
# is the median over the alternations. Prints a Markdown report ready for docs/perf/BENCHMARKS.md:
# one machine's section, keyed by its CPU model and ISA; `--out docs/perf/BENCHMARKS.md` puts it there.
#
#   scripts/bench-vs-llamacpp.sh [options] [MODEL.gguf ...]
#
# Without MODEL arguments it measures the demo model (Qwen2.5-Coder-0.5B Q4_K_M, found with
# scripts/fetch-demo-model.sh or $TBOOST_DEMO_MODEL) and the tinyllama-1.1b shape as Q4_0,
# Q8_0, BF16 and F16, written once into the cache directory with `tboost synth`.
#
# Options (each also settable by the environment variable in brackets):
#   --llama-bench BIN          llama.cpp's llama-bench            [LLAMA_BENCH]
#   --llama-batched-bench BIN  llama.cpp's llama-batched-bench    [LLAMA_BATCHED_BENCH]
#   --tboost BIN               the tboost binary (default: target/release/tboost, built if missing)
#   --threads N                threads for both engines (default 2)
#   --precision P              tboost's matmul precision, exact or fast (default fast: 8-bit
#                              activations for quantized weights, bf16 dot products for bf16
#                              ones, as llama.cpp's CPU dot products do; exact is f32 activations)
#   --runs N                   alternations per model (default 3, at least 2 for a median)
#   --cache DIR                where the synthetic GGUF files go [TBOOST_BENCH_CACHE]
#                              (default ~/.cache/tboost/bench)
#   --idle PCT                 CPU idle percentage wanted before each run (default 90)
#   --wait S                   seconds to wait for it before running anyway, noted (default 120)
#   --settle S                 seconds of pause before every timed process (default 5): on a VM
#                              the memory the previous process freed is reported to the host for
#                              a few seconds after, and a run inside that window is slower
#   --no-concurrency           skip the concurrent-request rows
#   --depth N                  also the long-context rows on the first model: prefill N tokens
#                              (llama-bench -p N -n 0) and decode 64 tokens at depth N
#                              (llama-bench -n 64 -d N), once per --kv-dtype
#   --kv-dtype LIST            tboost KV cache types for the --depth rows, comma-separated
#                              (default f16, llama.cpp's own; e.g. f16,q8_0)
#   --quick                    a smoke run: the `small` shape as Q8_0 and BF16 plus the demo
#                              model if cached, pp64/tg16, concurrency 1,4, one alternation
#   --out FILE                 also write the report to FILE; when FILE already holds machine sections
#                              (docs/perf/BENCHMARKS.md), replace this machine's section, or append
#                              one, and keep the others
#   --raw DIR                  keep every run's raw output (JSON, logs) in DIR
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "bench-vs-llamacpp: $*" >&2; exit 2; }
note() { echo "bench-vs-llamacpp: $*" >&2; }

LLAMA_BENCH="${LLAMA_BENCH:-}"
LLAMA_BATCHED_BENCH="${LLAMA_BATCHED_BENCH:-}"
TBOOST="" PRECISION=fast THREADS=2 RUNS=3 IDLE=90 WAIT=120 SETTLE=5 QUICK=0 CONC=1 OUT="" KEEP="" DEPTH=0 KVS=f16
CACHE="${TBOOST_BENCH_CACHE:-$HOME/.cache/tboost/bench}"
MODELS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-bench) LLAMA_BENCH="$2"; shift 2 ;;
    --llama-batched-bench) LLAMA_BATCHED_BENCH="$2"; shift 2 ;;
    --tboost) TBOOST="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --precision) PRECISION="$2"; shift 2 ;;
    --runs) RUNS="$2"; shift 2 ;;
    --cache) CACHE="$2"; shift 2 ;;
    --idle) IDLE="$2"; shift 2 ;;
    --wait) WAIT="$2"; shift 2 ;;
    --settle) SETTLE="$2"; shift 2 ;;
    --no-concurrency) CONC=0; shift ;;
    --depth) DEPTH="$2"; shift 2 ;;
    --kv-dtype) KVS="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --raw) KEEP="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) MODELS+=("$1"); shift ;;
  esac
done

how_to_get_llamacpp="set LLAMA_BENCH and LLAMA_BATCHED_BENCH (or --llama-bench / --llama-batched-bench) to the
llama-bench and llama-batched-bench binaries of a llama.cpp build: CPU only, Release, GGML_NATIVE=ON,
built outside this repository from llama.cpp's public source following its own build documentation
(docs/build.md there); tboost never builds or ships llama.cpp"
[ -n "$LLAMA_BENCH" ] || die "LLAMA_BENCH is not set: $how_to_get_llamacpp"
[ -x "$LLAMA_BENCH" ] || die "LLAMA_BENCH=$LLAMA_BENCH is not an executable file: $how_to_get_llamacpp"
if [ "$CONC" = 1 ]; then
  [ -n "$LLAMA_BATCHED_BENCH" ] || die "LLAMA_BATCHED_BENCH is not set (or pass --no-concurrency): $how_to_get_llamacpp"
  [ -x "$LLAMA_BATCHED_BENCH" ] || die "LLAMA_BATCHED_BENCH=$LLAMA_BATCHED_BENCH is not an executable file: $how_to_get_llamacpp"
fi
command -v python3 >/dev/null || die "python3 is needed to read the engines' JSON and tables"
case "$RUNS" in ''|*[!0-9]*) die "--runs must be a number, got '$RUNS'" ;; esac
case "$THREADS" in ''|*[!0-9]*|0) die "--threads must be a positive number, got '$THREADS'" ;; esac
case "$DEPTH" in ''|*[!0-9]*) die "--depth must be a number of tokens, got '$DEPTH'" ;; esac

if [ -z "$TBOOST" ]; then
  TBOOST=target/release/tboost
  if [ ! -x "$TBOOST" ]; then
    note "building tboost (release)..."
    cargo build --release --bin tboost >&2
  fi
fi
[ -x "$TBOOST" ] || die "--tboost $TBOOST is not an executable file"

DTG=64 PP=512 TG=128 NPL=1,4,16 NPP=32 NTG=64 SHAPE=tinyllama-1.1b DTYPES="q4_0 q8_0 bf16 f16"
if [ "$QUICK" = 1 ]; then
  PP=64 TG=16 NPL=1,4 RUNS=1 SHAPE=small DTYPES="q8_0 bf16" WAIT=10
fi

if [ ${#MODELS[@]} -eq 0 ]; then
  demo="${TBOOST_DEMO_MODEL:-}"
  if [ -z "$demo" ] && [ "$QUICK" = 0 ]; then
    demo="$(scripts/fetch-demo-model.sh)" || die "cannot get the demo model (scripts/fetch-demo-model.sh failed)"
  fi
  [ -z "$demo" ] && [ -f "$HOME/.cache/tboost/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" ] &&
    demo="$HOME/.cache/tboost/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
  [ -n "$demo" ] && MODELS+=("$demo")
  mkdir -p "$CACHE"
  for d in $DTYPES; do
    f="$CACHE/$SHAPE-$d.gguf"
    if [ ! -s "$f" ]; then
      note "writing $f"
      "$TBOOST" synth --shape "$SHAPE" --dtype "$d" --out "$f.tmp" && mv "$f.tmp" "$f"
    fi
    MODELS+=("$f")
  done
fi
for m in "${MODELS[@]}"; do [ -f "$m" ] || die "model file $m does not exist"; done

if [ -n "$KEEP" ]; then
  mkdir -p "$KEEP"; RAW="$(cd "$KEEP" && pwd)"
else
  RAW="$(mktemp -d)"
  trap 'rm -rf "$RAW"' EXIT
fi

# CPU idle percentage over one second, from /proc/stat.
cpu_idle() {
  local a b
  a=($(head -1 /proc/stat)); sleep 1; b=($(head -1 /proc/stat))
  local idle=$(( (b[4] + b[5]) - (a[4] + a[5]) )) total=0 i
  for i in 1 2 3 4 5 6 7 8; do total=$(( total + b[i] - a[i] )); done
  [ "$total" -gt 0 ] || { echo 100; return; }
  echo $(( 100 * idle / total ))
}

# Waits (up to --wait seconds) for the machine to be idle; records what it saw.
BUSY_RUNS=0
wait_idle() {
  local what="$1" start=$SECONDS idle
  while :; do
    idle=$(cpu_idle)
    if [ "$idle" -ge "$IDLE" ]; then
      echo "$what idle=$idle load=$(cut -d' ' -f1 /proc/loadavg)" >> "$RAW/idle.log"
      return
    fi
    if [ $(( SECONDS - start )) -ge "$WAIT" ]; then
      note "machine busy before $what (CPU idle $idle% < $IDLE% after ${WAIT}s); running anyway, noted"
      echo "$what BUSY idle=$idle load=$(cut -d' ' -f1 /proc/loadavg)" >> "$RAW/idle.log"
      BUSY_RUNS=$((BUSY_RUNS + 1))
      return
    fi
    sleep 5
  done
}

# A pause before every timed process. The guest reports freed memory to the host (virtio-balloon
# free page reporting, 2 MiB chunks about every 2 s), and each report slowed a run for a moment:
# tboost's pp512 on the demo model fell 10-18% in the seconds after its bandwidth probe had
# freed 960 MiB. Every process here frees its memory on exit, so each run waits the reports out.
settle() { sleep "$SETTLE"; }

# Share of CPU time the hypervisor took from this VM (/proc/stat "steal") while a command ran:
# `steal_begin`, the command, then `steal_end WHAT` appends "WHAT steal=PCT" to steal.log. The
# noisy-neighbour cost that an idle check before the run cannot see.
steal_begin() { STEAL_A=($(head -1 /proc/stat)); }
steal_end() {
  local b=($(head -1 /proc/stat)) total=0 i
  for i in 1 2 3 4 5 6 7 8; do total=$(( total + b[i] - STEAL_A[i] )); done
  [ "$total" -gt 0 ] || total=1
  echo "$1 steal=$(( 1000 * (b[8] - STEAL_A[8]) / total ))" >> "$RAW/steal.log"
}

run_tboost() { # model run-index
  local m="$1" r="$2"
  wait_idle "tboost $(basename "$m") #$r"
  # As llama-bench measures them: pp on its own, and tg from an (almost) empty context rather
  # than after the pp prompt, whose attention would make each step slower.
  settle
  steal_begin
  "$TBOOST" bench --model "$m" --prefill "$PP" --decode 1 --threads "$THREADS" --repeat 1 --precision "$PRECISION" --json \
    > "$RAW/tbp.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "tboost bench failed on $m (see above)"
  settle
  "$TBOOST" bench --model "$m" --prefill 1 --decode "$TG" --threads "$THREADS" --repeat 1 --precision "$PRECISION" --json \
    > "$RAW/tb.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "tboost bench failed on $m (see above)"
  steal_end tboost
}

run_llama() {
  local m="$1" r="$2"
  wait_idle "llama-bench $(basename "$m") #$r"
  # The same streaming-read probe tboost bench takes beside its decode, taken just before
  # llama-bench: this VM's bandwidth moves from minute to minute (23-56 GB/s), so each
  # engine's decode is also set against the bandwidth of its own moment.
  "$TBOOST" bench --synthetic small --dtype q8_0 --prefill 1 --decode 1 --repeat 1 --threads "$THREADS" --json \
    > "$RAW/lbw.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "tboost bench (bandwidth probe) failed"
  settle
  steal_begin
  "$LLAMA_BENCH" -m "$m" -t "$THREADS" -p "$PP" -n "$TG" -r 1 -o json \
    > "$RAW/lb.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "llama-bench failed on $m (see $RAW/stderr.log)"
  steal_end llama.cpp
}

run_tboost_conc() {
  local m="$1" r="$2"
  wait_idle "tboost concurrency $(basename "$m") #$r"
  settle
  "$TBOOST" bench --model "$m" --prefill "$NPP" --decode "$NTG" --threads "$THREADS" --repeat 1 --precision "$PRECISION" \
    --concurrency "$NPL" --concurrency-prompt "$NPP" --json \
    > "$RAW/tbc.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "tboost bench --concurrency failed on $m"
}

run_llama_conc() {
  local m="$1" r="$2"
  wait_idle "llama-batched-bench $(basename "$m") #$r"
  settle
  "$LLAMA_BATCHED_BENCH" -m "$m" -t "$THREADS" -c 4096 -b 2048 -ub 512 -npp "$NPP" -ntg "$NTG" -npl "$NPL" \
    > "$RAW/lbc.$(basename "$m").$r.txt" 2>> "$RAW/stderr.log" || die "llama-batched-bench failed on $m"
}

for m in "${MODELS[@]}"; do
  for r in $(seq 1 "$RUNS"); do
    note "$(basename "$m"): alternation $r/$RUNS"
    run_tboost "$m" "$r"
    run_llama "$m" "$r"
  done
done
# Long-context rows: prefill DEPTH tokens, and decode at depth DEPTH (tboost decodes right
# after its DEPTH-token prefill; llama-bench -d fills the context first), per KV type.
run_tboost_depth() { # model kv run-index
  local m="$1" kv="$2" r="$3"
  wait_idle "tboost depth $DEPTH kv $kv $(basename "$m") #$r"
  settle
  "$TBOOST" bench --model "$m" --prefill "$DEPTH" --decode "$DTG" --threads "$THREADS" --repeat 1 --precision "$PRECISION" \
    --kv-dtype "$kv" --json > "$RAW/tbd.$kv.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "tboost bench --kv-dtype $kv failed on $m"
}
run_llama_depth() {
  local m="$1" r="$2"
  wait_idle "llama-bench depth $DEPTH $(basename "$m") #$r"
  settle
  "$LLAMA_BENCH" -m "$m" -t "$THREADS" -p "$DEPTH" -n 0 -r 1 -o json \
    > "$RAW/lbdp.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "llama-bench -p $DEPTH failed on $m"
  settle
  "$LLAMA_BENCH" -m "$m" -t "$THREADS" -p 0 -n "$DTG" -d "$DEPTH" -r 1 -o json \
    > "$RAW/lbdg.$(basename "$m").$r.json" 2>> "$RAW/stderr.log" || die "llama-bench -d $DEPTH failed on $m"
}
if [ "$DEPTH" -gt 0 ]; then
  dm="${MODELS[0]}"
  for r in $(seq 1 "$RUNS"); do
    note "$(basename "$dm"): depth $DEPTH alternation $r/$RUNS"
    for kv in ${KVS//,/ }; do run_tboost_depth "$dm" "$kv" "$r"; done
    run_llama_depth "$dm" "$r"
  done
fi

# Concurrency rows: the demo model (the issue's target) or, with explicit files, the first.
if [ "$CONC" = 1 ]; then
  cm="${MODELS[0]}"
  for r in $(seq 1 "$RUNS"); do
    note "$(basename "$cm"): concurrency alternation $r/$RUNS"
    run_tboost_conc "$cm" "$r"
    run_llama_conc "$cm" "$r"
  done
fi

CPU="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
# The instruction sets the kernels choose between; with the CPU model, the key of the machine's
# section in docs/perf/BENCHMARKS.md.
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2-) "
# The CPU kind (a microarchitecture name) from the vendor, family and model numbers: the model
# name alone ("AMD EPYC" on many VMs) cannot tell Zen 2 from Zen 3.
cpu_kind() {
  local vendor fam model
  vendor="$(grep -m1 '^vendor_id' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
  fam="$(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
  model="$(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
  case "$vendor:$fam" in
    AuthenticAMD:23) if [ "$model" -ge 48 ]; then echo "Zen 2"; else echo "Zen/Zen+"; fi ;;
    AuthenticAMD:25) if { [ "$model" -ge 16 ] && [ "$model" -le 31 ]; } || { [ "$model" -ge 96 ] && [ "$model" -le 127 ]; } || { [ "$model" -ge 160 ] && [ "$model" -le 175 ]; }; then echo "Zen 4"; else echo "Zen 3"; fi ;;
    AuthenticAMD:26) echo "Zen 5" ;;
    GenuineIntel:6) if [[ "$FLAGS" == *" amx_tile "* ]]; then echo "Intel family 6 model $model, AMX"; else echo "Intel family 6 model $model"; fi ;;
    *) echo "$vendor family $fam model $model" ;;
  esac
}
CPU="$CPU, $(cpu_kind)"
has_flag() { [[ "$FLAGS" == *" $1 "* ]]; }
if has_flag avx512f; then
  ISA="AVX-512"
  if has_flag avx512_vnni; then ISA+=", VNNI"; fi
  if has_flag avx512_bf16; then ISA+=", AVX512_BF16"; fi
  if has_flag amx_int8; then ISA+=", AMX"; fi
elif has_flag avx2; then
  ISA="AVX2"
  if has_flag avx_vnni; then ISA+=", AVX-VNNI"; fi
else
  ISA="no AVX2"
fi
python3 - "$RAW" "$RUNS" "$THREADS" "$PP" "$TG" "$NPP" "$NTG" "$NPL" "$CPU" "$BUSY_RUNS" "$CONC" "$PRECISION" "$ISA" "$DEPTH" "$DTG" "$KVS" "${MODELS[@]}" <<'PY' | tee "$RAW/report.md"
import json, os, re, statistics, sys, datetime
raw, runs, threads, pp, tg, npp, ntg, npl, cpu, busy, conc, precision, isa, depth, dtg, kvs = sys.argv[1:17]
models = sys.argv[17:]
depth, dtg, kvs = int(depth), int(dtg), kvs.split(',')
runs, pp, tg = int(runs), int(pp), int(tg)
npl = [int(v) for v in npl.split(',')]

def med(v):
    return statistics.median(v) if v else float('nan')

def llama_rows(path):
    text = open(path).read()
    # llama-bench -o json: a list of test records (older builds print one object per line).
    try:
        recs = json.loads(text)
    except json.JSONDecodeError:
        recs = [json.loads(l) for l in text.splitlines() if l.strip().startswith('{')]
    p = [r['avg_ts'] for r in recs if r.get('n_prompt') == pp and r.get('n_gen') == 0]
    g = [r['avg_ts'] for r in recs if r.get('n_gen') == tg and r.get('n_prompt') == 0]
    return (p[0] if p else float('nan')), (g[0] if g else float('nan'))

def batched(path):
    # Table rows: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    out = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) >= 10 and cells[0].isdigit():
            out[int(cells[2])] = float(cells[7])
    return out

def llama_depth(path, which):
    text = open(path).read()
    try:
        recs = json.loads(text)
    except json.JSONDecodeError:
        recs = [json.loads(l) for l in text.splitlines() if l.strip().startswith('{')]
    v = [rec['avg_ts'] for rec in recs if (rec.get('n_gen') == 0) == (which == 'p')]
    return v[0] if v else float('nan')

def r(a, b):
    return f"{a / b:.2f}×" if b and b == b and a == a else "n/a"

print(f"<!-- machine: {cpu} | {isa} -->")
print(f"## {cpu} ({isa}), {datetime.datetime.now():%Y-%m-%d %H:%M}")
print()
print(f"tboost vs llama.cpp, {datetime.date.today().isoformat()}, {cpu}, {threads} threads, "
      f"median of {runs} alternation(s) (A B A B), same GGUF files, tboost --precision {precision}")
print()
print(f"| model | tboost pp{pp} | llama.cpp pp{pp} | pp ratio | tboost pp spread | llama.cpp pp spread | tboost tg{tg} | llama.cpp tg{tg} | tg ratio | tg roof | tboost / roof | llama.cpp / roof | 1.3× llama.cpp / roof |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
per_run = []
kernels = set()
for m in models:
    b = os.path.basename(m)
    tp, td, lp, ld, roof, lroof = [], [], [], [], [], []
    for i in range(1, runs + 1):
        tp.append(json.load(open(f"{raw}/tbp.{b}.{i}.json"))['prefill_tokens_per_s'])
        j = json.load(open(f"{raw}/tb.{b}.{i}.json"))
        td.append(j['decode_tokens_per_s'])
        # The decode roof: measured read bandwidth / the weight bytes each token streams.
        roof.append(j['memory_bandwidth_bytes_per_s'] / j['weight_bytes'])
        # The same probe taken just before this alternation's llama-bench run.
        lroof.append(json.load(open(f"{raw}/lbw.{b}.{i}.json"))['memory_bandwidth_bytes_per_s'] / j['weight_bytes'])
        p, g = llama_rows(f"{raw}/lb.{b}.{i}.json")
        lp.append(p); ld.append(g)
    a, c, e, f = med(tp), med(lp), med(td), med(ld)
    # Run-to-run spread of each engine's prefill: (max - min) / median over the alternations;
    # llama.cpp's is the machine's own noise in the same run.
    spread = (max(tp) - min(tp)) / a if a else float('nan')
    lspread = (max(lp) - min(lp)) / c if c == c and c else float('nan')
    print(f"| {b} | {a:.1f} | {c:.1f} | {r(a, c)} | {spread:.0%} | {lspread:.0%} | {e:.2f} | {f:.2f} | {r(e, f)} | {med(roof):.1f} | {e / med(roof):.0%} | {f / med(roof):.0%} | {1.3 * f / med(roof):.0%} |")
    per_run.append((b, td, ld, roof, lroof))
    kernels.add(json.load(open(f"{raw}/tb.{b}.1.json")).get('backend', '?'))
print()
print("Decode at each run's own bandwidth: the same probe taken just before every llama-bench run, "
      "so each engine's tg is set against the read bandwidth of its own minute. Per alternation, "
      "tokens/s (share of that run's roof):")
print()
print("| model | tboost tg per run | llama.cpp tg per run | tg ratio at equal bandwidth (median) |")
print("|---|---|---|---|")
for b, td, ld, roof, lroof in per_run:
    norm = [(t / rt) / (l / rl) for t, rt, l, rl in zip(td, roof, ld, lroof) if l == l and l]
    fmt = lambda v, rf: ", ".join(f"{x:.1f} ({x / y:.0%})" for x, y in zip(v, rf))
    print(f"| {b} | {fmt(td, roof)} | {fmt(ld, lroof)} | {med(norm):.2f}× |")
print()
print("tboost kernels (as `tboost bench` names its backend): " + ", ".join(sorted(kernels)))
if depth > 0:
    b = os.path.basename(models[0])
    print()
    print(f"Long context, {b}: prefill {depth} tokens, and decode {dtg} tokens at depth {depth} "
          f"(llama.cpp: llama-bench -p {depth} -n 0 and -n {dtg} -d {depth}, its f16 KV cache):")
    print()
    print("| engine | KV cache | prefill tokens/s | ratio | decode tokens/s at depth | ratio | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    lp = med([llama_depth(f"{raw}/lbdp.{b}.{i}.json", 'p') for i in range(1, runs + 1)])
    lg = med([llama_depth(f"{raw}/lbdg.{b}.{i}.json", 'g') for i in range(1, runs + 1)])
    for kv in kvs:
        js = [json.load(open(f"{raw}/tbd.{kv}.{b}.{i}.json")) for i in range(1, runs + 1)]
        p = med([j['prefill_tokens_per_s'] for j in js])
        g = med([j['decode_tokens_per_s'] for j in js])
        rss = med([j['peak_rss_bytes'] for j in js]) / 2**20
        print(f"| tboost | {kv} | {p:.1f} | {r(p, lp)} | {g:.2f} | {r(g, lg)} | {rss:.0f} |")
    print(f"| llama.cpp | f16 | {lp:.1f} | | {lg:.2f} | | |")
if conc == '1':
    b = os.path.basename(models[0])
    print()
    print(f"Aggregate decode tokens/s of N concurrent requests ({npp}-token prompts, {ntg} new tokens each), {b}:")
    print()
    print("| requests | tboost | llama.cpp (batched-bench S_TG) | ratio |")
    print("|---|---|---|---|")
    for n in npl:
        t, l = [], []
        for i in range(1, runs + 1):
            j = json.load(open(f"{raw}/tbc.{b}.{i}.json"))
            t += [c['aggregate_decode_tokens_per_s'] for c in j['concurrency'] if c['requests'] == n]
            l.append(batched(f"{raw}/lbc.{b}.{i}.txt").get(n, float('nan')))
        print(f"| {n} | {med(t):.1f} | {med(l):.1f} | {r(med(t), med(l))} |")
print()
log = open(f"{raw}/idle.log").read().splitlines()
idles = [int(re.search(r'idle=(\d+)', l).group(1)) for l in log]
print(f"Machine state before each run: CPU idle {min(idles)}–{max(idles)}%"
      + (f"; {busy} run(s) started on a busy machine (below the idle threshold)" if int(busy) else "; idle throughout"))
steal = {}
for l in open(f"{raw}/steal.log").read().splitlines():
    who, v = l.rsplit(' steal=', 1)
    steal.setdefault(who, []).append(int(v) / 10)
print("CPU time taken by the hypervisor (steal) during the single-request runs: "
      + ", ".join(f"{w} {min(v):.1f}–{max(v):.1f}%" for w, v in steal.items()))
print()
print("tg roof: the streaming-read bandwidth tboost bench measures beside its decode (best of 8 reads) "
      "÷ weight bytes per token. Where 1.3× llama.cpp / roof exceeds 100%, the decode goal lies above "
      "the measured roof.")
print()
print("<!-- end machine -->")
PY

# --out: into a file of machine sections (docs/perf/BENCHMARKS.md) this machine's section goes in
# place of its old one, or at the end; any other file gets the report alone.
if [ -n "$OUT" ]; then
  python3 - "$RAW/report.md" "$OUT" <<'PY'
import os, re, sys
report, out = sys.argv[1:3]
new = open(report).read().strip() + "\n"
key = re.match(r"<!-- machine: (.*?) -->", new).group(1)
doc = open(out).read() if os.path.exists(out) else ""
if "<!-- machine: " in doc:
    section = re.compile(r"<!-- machine: " + re.escape(key) + r" -->\n.*?<!-- end machine -->\n", re.S)
    if section.search(doc):
        doc = section.sub(lambda m: new, doc, count=1)
    else:
        doc = doc.rstrip() + "\n\n" + new
else:
    doc = new
open(out, "w").write(doc)
print(f"bench-vs-llamacpp: section '{key}' written into {out}", file=sys.stderr)
PY
fi
