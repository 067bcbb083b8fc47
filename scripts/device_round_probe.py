"""What a speculative round captured whole costs (speculative/device_round.py), against plain decoding and the
engine's own rounds, on one prompt at batch 1, greedy: the question the demo family's rows turn on.

    python scripts/device_round_probe.py --model outrider/demo/target (--draft-model outrider/demo/dflash |
        --spec-type mtp) [--k 7] [--tokens 256] [--device cuda|cpu]

On CUDA the round is captured as one CUDA graph and each round is one replay and one read of its verdict; on the
CPU it runs eagerly (a smoke test of the same code). Prints tok/s of the three, the rounds' mean accepted drafts,
and whether every committed token equals plain greedy decoding's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from outrider.config import EngineConfig
from outrider.engine.builder import build_engine
from outrider.engine.engine import Engine
from outrider.engine.request import Request
from outrider.kernels import ops
from outrider.params import SamplingParams
from outrider.speculative.device_round import DeviceRound


def decode(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """The engine's own greedy decoding of `tokens` tokens: (tokens, seconds after the first token)."""
    out: list[int] = []
    req = Request(list(prompt), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    engine.add_request(req, lambda o: out.extend(o.new_token_ids))
    while not out:
        engine.step()
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return out, time.perf_counter() - t0


def rounds(engine: Engine, prompt: list[int], tokens: int, k: int) -> tuple[list[int], float, float]:
    """Greedy decoding by device rounds after the engine's prefill: (tokens, seconds after the first, mean m)."""
    req = Request(list(prompt), SamplingParams(max_tokens=tokens + 2 * (k + 1), temperature=0.0, ignore_eos=True))
    engine.add_request(req, lambda o: None)
    while not req.output_ids:
        engine.step()
    engine.speculation.speculator.flush()
    width = -(-engine.max_model_len // engine.pool.block_size)
    dr = DeviceRound(engine.runner, engine.speculation.drafter, k, width)
    dr.load(req.all_ids[-1], [0] * k, req.num_tokens - 1, req.block_ids)
    position, out, accepted = req.num_tokens - 1, list(req.output_ids), []

    def reserve() -> None:
        blocks = len(req.block_ids)
        if not engine.pool.ensure(req, position + dr.reach()):
            raise SystemExit("the KV pool has no room for the rounds")
        if len(req.block_ids) != blocks:
            dr.set_blocks(req.block_ids)

    step = dr.run
    if engine.device.type == "cuda":
        reserve()
        graph = torch.cuda.CUDAGraph()
        with ops.graph_capture():  # (graph-only kernels, PDL: warmed up, so compiled, outside the capture)
            dr.run()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                dr.run()
        dr.load(req.all_ids[-1], [0] * k, req.num_tokens - 1, req.block_ids)  # (the warm run's state, undone)
        step = graph.replay
    t0 = time.perf_counter()
    while len(out) < tokens:
        reserve()
        step()
        got = dr.read()
        out += got
        accepted.append(len(got) - 1)
        position += len(got)
    seconds = time.perf_counter() - t0
    engine.abort(req.request_id)
    return out[:tokens], seconds, sum(accepted) / len(accepted)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", help="a DFlash or EAGLE-3 drafter")
    ap.add_argument("--spec-type", help="e.g. mtp (the target's own head)")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", default="outrider/demo/eval_prompts.json")
    args = ap.parse_args()
    common = dict(model=args.model, device=args.device, max_num_seqs=1, max_model_len=2048)
    plain = build_engine(EngineConfig(spec_type="none", **common))
    # (its own rounds step by step, as without device rounds: what the captured round is compared with)
    spec = build_engine(EngineConfig(draft_model=args.draft_model, spec_type=args.spec_type, spec_draft_n_max=args.k,
                               spec_device_round=False, **common))
    texts = json.loads(Path(args.prompts).read_text())
    for text in texts[:3]:
        text = text["prompt"] if isinstance(text, dict) else text
        prompt = plain.tokenizer.encode(text)
        want, plain_s = decode(plain, prompt, args.tokens)
        engine_out, engine_s = decode(spec, prompt, args.tokens)
        got, round_s, mean_m = rounds(spec, prompt, args.tokens, args.k)
        n = args.tokens - 1  # (tokens after the first)
        print(f"plain {n / plain_s:8.1f} tok/s | engine rounds {n / engine_s:8.1f} tok/s | device rounds "
              f"{(len(got) - 1) / round_s:8.1f} tok/s ({(len(got) - 1) / round_s / (n / plain_s):.2f}x plain), "
              f"mean m {mean_m:.2f}; equal to plain: engine {engine_out == want}, rounds {got == want}", flush=True)


if __name__ == "__main__":
    main()
