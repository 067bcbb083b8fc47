#!/usr/bin/env bash
# GPU tests + benchmarks on the device machine. Usage: scripts/gpu_run.sh MODE; logs land in $OUT. One device
# call runs at most 10 minutes, so each mode below fits one call; `full` (all of them) does not.
# tests: tests/gpu and the speculative engine tests (on the GPU when there is one), ~4-5 min.
# latency: batch-1 latency (8B vs HF, 0.6B, with phase profiles).
# kernels: kernel micro-benchmarks (attention, fused ops, skinny GEMM configs vs cuBLAS).
# throughput: throughput (0.6B, 8B), a kernel profile at throughput batch sizes and batch-32 latency (8B).
# spec-demo: bench spec on the demo family (draft model, MTP, DFlash) at batch 1, 8, 32 (issue 13's targets).
# spec-8b: bench spec on the Qwen3-8B presets with controlled acceptance (issue 13's targets; BENCH_TIMEOUT=500).
# ab: AB="DIR_A DIR_B" (trees from scripts/snapshot.sh, carried): batch-1 latency of each on this one machine,
#     alternated twice (freshly started machines differ by up to ~15%, so compare only within a call).
set -u -o pipefail
MODE=${1:-}
case "$MODE" in
  tests|latency|kernels|throughput|spec-demo|spec-8b|full) ;;
  ab) : "${AB:?ab needs AB=\"DIR_A DIR_B\" (trees from scripts/snapshot.sh)}" ;;
  *) echo "usage: scripts/gpu_run.sh tests|latency|kernels|throughput|spec-demo|spec-8b|full|ab" >&2; exit 2 ;;
esac
OUT=$(realpath -m "${OUT:-.out}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)"
} > "$OUT/env.txt" 2>&1

bench() {  # every bench line also goes to bench.log, with the exact command before it
  echo "\$ python -m outrider.bench $*" | tee -a "$OUT/bench.log"
  timeout "${BENCH_TIMEOUT:-300}" $PY -m outrider.bench "$@" 2>&1 | grep -v 'capturing CUDA graphs' | tee -a "$OUT/bench.log"
}

if [ "$MODE" = ab ]; then
  for round in 1 2; do
    for dir in $AB; do
      echo "== $dir (round $round)" | tee -a "$OUT/bench.log"
      (cd "$dir" && export PYTHONPATH="$PWD" && bench latency --random-weights qwen3-0.6b --ttft-prompt-len 0 &&
       bench latency --random-weights qwen3-8b --ttft-prompt-len 0)
    done
  done
  grep -E '^(==|latency)' "$OUT/bench.log"
  exit 0
fi

run() { [ "$MODE" = full ] || [ "$MODE" = "$1" ]; }
if run tests; then
  # tests/gpu, plus the speculative engine tests, which run on the GPU when there is one (verify graphs)
  timeout 480 $PY -m pytest tests/gpu tests/test_spec_engine.py -q -rs 2>&1 | tee "$OUT/tests.log"
fi
if run kernels; then
  bench kernels
fi
if run latency; then
  bench latency --random-weights qwen3-8b --compare hf --profile
  bench latency --random-weights qwen3-0.6b --profile
fi
if run throughput; then
  bench throughput --random-weights qwen3-0.6b
  bench throughput --random-weights qwen3-8b
  # where a throughput-sized decode step goes (batch and context near the workload's average, T=0.6)
  timeout 200 $PY scripts/profile_gpu.py --model qwen3-0.6b --batch 160 --prompt-len 700 --temperature 0.6 \
    --steps 32 --top 15 2>&1 | grep -v 'capturing CUDA graphs' | tee "$OUT/profile_throughput.log"
  bench latency --random-weights qwen3-8b --batch 32 --ttft-prompt-len 0
fi
if run spec-demo; then
  bench spec --model outrider/demo/target --draft-model outrider/demo/dflash --num-requests 64 --json "$OUT/spec-demo-dflash.json"
  bench spec --model outrider/demo/target --spec-type mtp --num-requests 64 --json "$OUT/spec-demo-mtp.json"
  bench spec --model outrider/demo/target --draft-model outrider/demo/draft --num-requests 64 --json "$OUT/spec-demo-draft.json"
fi
if run spec-8b; then
  bench spec --random-weights qwen3-8b --spec-type dflash --acceptance 0.86 0.7 0 --json "$OUT/spec-8b-dflash.json"
  bench spec --random-weights qwen3-8b --spec-type mtp --acceptance 0.7 0 --draft-n-max 3 --json "$OUT/spec-8b-mtp.json"
  bench spec --random-weights qwen3-8b --spec-type draft --acceptance 0.8 0.7 0 --draft-n-max 4 --json "$OUT/spec-8b-draft.json"
fi
echo "== summary"; grep -E '^(==|latency|ttft|hf-|throughput|kernel|profile|spec|  tau)' "$OUT/bench.log"
if [ -f "$OUT/tests.log" ]; then tail -3 "$OUT/tests.log"; fi
