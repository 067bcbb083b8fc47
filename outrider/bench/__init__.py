"""`outrider bench {latency,throughput,serve,kernels}`: speed measurements that each print bandwidth vs roofline."""

from __future__ import annotations

import argparse

from outrider.bench.shapes import RANDOM_MODELS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="outrider bench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    src = common.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory or hub repo id")
    src.add_argument("--random-weights", choices=sorted(RANDOM_MODELS), help="real shape, random bf16 weights")
    common.add_argument("--dtype", default="auto")
    common.add_argument("--device", default="cuda")
    common.add_argument("--eager", action="store_true", help="disable CUDA graphs")
    common.add_argument("--no-overlap", action="store_true", help="disable overlap scheduling")
    common.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--peak-bw", type=float, help="roofline bandwidth in GB/s (default: the GPU's spec)")
    common.add_argument("--json", help="also write the result rows to this JSON file")
    common.add_argument("--json-schema", metavar="FILE",
                        help="also run the workload constrained by this JSON Schema and compare tok/s (with "
                             "--random-weights the stub tokenizer is trained to the model's vocabulary size)")

    lat = sub.add_parser("latency", parents=[common], help="batch-B decode tok/s, ms/token and TTFT")
    lat.add_argument("--prompt-len", type=int, default=128)
    lat.add_argument("--gen", type=int, default=256)
    lat.add_argument("--batch", type=int, default=1)
    lat.add_argument("--ttft-prompt-len", type=int, default=1024, help="extra TTFT line at this length (0 = off)")
    lat.add_argument("--compare", choices=["hf"], help="also run HF transformers on the same weights")
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
    ker = sub.add_parser("kernels", help="Triton kernels alone vs torch (attention decode, fused ops)")
    ker.add_argument("--device", default="cuda")
    ker.add_argument("--peak-bw", type=float)
    ker.add_argument("--json")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from outrider.bench.report import Reporter
    from outrider.bench.shapes import spec_bandwidth

    args = _parser().parse_args(argv)
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
    else:
        from outrider.bench import kernels as mod
    mod.run(args, reporter)
    return 0
