#!/usr/bin/env bash
# `outrider bench serve` on the GPU: write an HF checkpoint of a named shape with random bf16 weights (and the
# tiny test tokenizer), start `outrider serve` on it, then run N concurrent streaming clients per concurrency.
# Usage: scripts/bench_serve.sh SHAPE [CONCURRENCY...]   (logs in $OUT, default .out)
set -eu -o pipefail
SHAPE=${1:-qwen3-0.6b}
shift || true
CONCS=${*:-1 16 64}
OUT=${OUT:-.out}
PY=${PYTHON:-python3}
DIR=/tmp/outrider-random-$SHAPE
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY - "$SHAPE" "$DIR" <<'PYEOF'
import sys, torch
from outrider.bench.hf import hf_random_model
from outrider.testing.tokenizer import write_tiny_tokenizer
model = hf_random_model(sys.argv[1], torch.device("cuda"))
model.save_pretrained(sys.argv[2])
write_tiny_tokenizer(sys.argv[2])
PYEOF
MAXC=$(echo $CONCS | tr ' ' '\n' | sort -n | tail -1)
$PY -m outrider serve -m "$DIR" --port 8089 -np "$MAXC" -c 2048 --spec-type none > "$OUT/serve-$SHAPE.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf localhost:8089/health >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/serve-$SHAPE.log"; exit 1; }
  sleep 0.5
done
for c in $CONCS; do
  echo "\$ python -m outrider.bench serve --url http://127.0.0.1:8089 --random-weights $SHAPE --concurrency $c --num-requests $((4 * c))" | tee -a "$OUT/bench.log"
  $PY -m outrider.bench serve --url http://127.0.0.1:8089 --random-weights "$SHAPE" --concurrency "$c" \
    --num-requests $((4 * c)) 2>&1 | tee -a "$OUT/bench.log"
done
