"""`outrider bench {latency,throughput,serve,kernels,spec}`: speed measurements. latency, throughput, serve and
kernels print bandwidth against the roofline; spec compares speculative with plain decoding."""

from __future__ import annotations

import argparse

from outrider.bench.hf import CONFIGS as HF_CONFIGS
from outrider.bench.shapes import RANDOM_MODELS
from outrider.quant.writers import BENCH_FORMATS as QUANT_FORMATS
from outrider.quant.writers import GGUF_MIXES
from outrider.config import PREFILL_GRAPH_TOKENS_DEFAULT
from outrider.speculative.kinds import NAMES as KINDS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="outrider bench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    engine_opts = argparse.ArgumentParser(add_help=False)
    src = engine_opts.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory or hub repo id")
    src.add_argument("--random-weights", choices=sorted(RANDOM_MODELS), help="real shape, random bf16 weights")
    engine_opts.add_argument("--dtype", default="auto")
    engine_opts.add_argument("--device", default="cuda")
    engine_opts.add_argument("--eager", action="store_true", help="disable CUDA graphs")
    engine_opts.add_argument("--no-overlap", action="store_true", help="disable overlap scheduling")
    engine_opts.add_argument("--prefill-graph-tokens", type=int, metavar="N",
                             help="lone prefill chunks of up to N tokens replay CUDA graphs (default "
                             f"{PREFILL_GRAPH_TOKENS_DEFAULT}; 0: eager)")
    engine_opts.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine_opts.add_argument("--seed", type=int, default=0)
    engine_opts.add_argument("--json", help="also write the results to this JSON file")
    common = argparse.ArgumentParser(add_help=False, parents=[engine_opts])
    common.add_argument("--peak-bw", type=float, help="roofline bandwidth in GB/s (default: the GPU's spec)")
    common.add_argument("--json-schema", metavar="FILE",
                        help="also run the workload constrained by this JSON Schema and compare tok/s (with "
                             "--random-weights the stub tokenizer is trained to the model's vocabulary size)")

    lat = sub.add_parser("latency", parents=[common], help="batch-B decode tok/s, ms/token and TTFT")
    lat.add_argument("--prompt-len", type=int, default=128)
    lat.add_argument("--gen", type=int, default=256)
    lat.add_argument("--batch", type=int, default=1)
    lat.add_argument("--ttft-prompt-len", type=int, default=1024, help="extra TTFT line at this length (0 = off)")
    lat.add_argument("--compare", choices=["hf"], help="also run HF transformers (same shape and batch, own process)")
    lat.add_argument("--hf-configs", nargs="+", choices=HF_CONFIGS, default=list(HF_CONFIGS),
                     help="HF configurations for --compare hf (default: all)")
    lat.add_argument("--hf-timeout", type=float, default=900, help="seconds an HF configuration may take")
    lat.add_argument("--profile", action="store_true", help="also print where a step's time goes")

    thr = sub.add_parser("throughput", parents=[common], help="nano-vllm workload: output tok/s")
    thr.add_argument("--num-requests", type=int, default=256)
    thr.add_argument("--min-len", type=int, default=100)
    thr.add_argument("--max-len", type=int, default=1024)
    thr.add_argument("--max-num-seqs", type=int, default=256)
    thr.add_argument("--max-num-batched-tokens", type=int, default=16384)

    srv = sub.add_parser("serve", help="N concurrent streaming clients against a running server")
    srv.add_argument("--url", default="http://127.0.0.1:8080")
    srv.add_argument("--random-weights", choices=sorted(RANDOM_MODELS), help="shape served (for bandwidth)")
    srv.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn below this")
    srv.add_argument("--concurrency", type=int, default=8)
    srv.add_argument("--num-requests", type=int, default=64)
    srv.add_argument("--prompt-len", type=int, default=256)
    srv.add_argument("--gen", type=int, default=128)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--peak-bw", type=float)
    srv.add_argument("--json")
    qnt = sub.add_parser("quant", parents=[common], help="quantized weights (GGUF, FP8, AWQ, GPTQ) vs bf16 with "
                         "--random-weights: decode tok/s, batch throughput, TTFT and GPU memory after load")
    qnt.add_argument("--weights-format", nargs="+", choices=QUANT_FORMATS, default=["q4_k_m", "q8_0", "fp8", "awq",
                                                                                     "bf16"])
    qnt.add_argument("--checkpoint-dir", default="bench-checkpoints",
                     help="where the random checkpoints are written (and reused)")
    qnt.add_argument("--prompt-len", type=int, default=128)
    qnt.add_argument("--gen", type=int, default=128)
    qnt.add_argument("--batch", type=int, default=32, help="the throughput batch (batch 1 is always measured)")
    qnt.add_argument("--ttft-prompt-len", type=int, default=1024)
    qnt.add_argument("--kernels", action="store_true", help="instead: each format's product alone vs bf16 cuBLAS "
                     "at Qwen3-8B's projection shapes, with the fastest kernel config")
    qnt.add_argument("--kernel-formats", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "FP8", "INT4"],
                     choices=["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_K", "FP8", "INT4"])
    qnt.add_argument("--kernel-rows", nargs="+", type=int, default=[1, 5, 16, 32, 512], help="--kernels: rows of x")
    qnt.add_argument("--tune", action="store_true", help="--kernels: also time candidate configs (slow: compiles)")
    ker = sub.add_parser("kernels", help="Triton kernels alone vs torch (attention decode, fused ops)")
    ker.add_argument("--device", default="cuda")
    ker.add_argument("--peak-bw", type=float)
    ker.add_argument("--json")

    spc = sub.add_parser("spec", parents=[engine_opts],
                         help="speculative vs plain decoding: speedup, tokens per round, acceptance, round split")
    spc.add_argument("--draft-model", help="with --model: the drafter's checkpoint (draft model or DFlash)")
    spc.add_argument("--spec-type", choices=KINDS,
                     help="drafter kind (--model: detected when left out; --random-weights: the preset)")
    spc.add_argument("--acceptance", type=float, nargs="+", metavar="ALPHA",
                     help="controlled acceptance: keep each draft position with probability ALPHA (one run each)")
    spc.add_argument("--draft-n-max", type=int, help="draft length cap k (default: the drafter's)")
    spc.add_argument("--spec-token-map", metavar="FILE",
                     help="MTP / DFlash: the token ids drafts may propose (serve's --spec-token-map)")
    spc.add_argument("--no-device-round", action="store_true",
                     help="a request decoding alone runs its rounds step by step, not captured whole on the device "
                     "(spec_device_round: on by default with CUDA graphs)")
    spc.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    spc.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    spc.add_argument("--num-requests", type=int, default=16, help="per batch size, rounded up to whole batches")
    spc.add_argument("--prompt-len", type=int, help="--random-weights: prompt length (default 128)")
    spc.add_argument("--weights-format", default="bf16", choices=[*GGUF_MIXES, "fp8", "awq", "bf16"],
                     help="--random-weights: the target's decoder projections random in this quantized format "
                          "(embedding and LM head stay bf16)")
    spc.add_argument("--prompts", help="--model: a JSON list of prompts (default: the demo's eval_prompts.json; "
                     "bench.workloads writes the n-gram workloads: edit, novel)")
    spc.add_argument("--spec-ngram-simple-size-n", type=int, default=12, help="ngram: tokens looked up")
    spc.add_argument("--spec-ngram-simple-size-m", type=int, default=48, help="ngram: most tokens drafted")
    spc.add_argument("--spec-ngram-simple-min-hits", type=int, default=1,
                     help="ngram: earlier occurrences needed to draft (a huge value: lookup that never drafts)")
    spc.add_argument("--repeats", type=int, default=3,
                     help="timed passes per side, plain and speculative interleaved; the best of each is reported")
    # Each engine's KV pool holds the workload exactly (both engines share the GPU): no memory share to choose
    spc.set_defaults(gpu_memory_utilization=None)
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from outrider.bench.report import Reporter
    from outrider.bench.shapes import spec_bandwidth

    args = _parser().parse_args(argv)
    if args.cmd == "spec":
        from outrider.bench import spec

        spec.run(args)
        return 0
    if args.peak_bw:
        peak = args.peak_bw * 1e9
    else:
        peak = spec_bandwidth(torch.device("cuda")) if torch.cuda.is_available() else None
    reporter = Reporter(peak, args.json)
    if args.cmd == "latency":
        from outrider.bench import latency as mod
    elif args.cmd == "throughput":
        from outrider.bench import throughput as mod
    elif args.cmd == "serve":
        from outrider.bench import serve as mod
    elif args.cmd == "quant":
        from outrider.bench import quant as mod
    else:
        from outrider.bench import kernels as mod
    mod.run(args, reporter)
    return 0
