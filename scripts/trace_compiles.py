"""Run a module with every Triton compile traced: a compile after the engine's warm-up is a stall some request
pays (seconds, on the first step of a new shape). Each compile prints the kernel, its compile time, its constexpr
specialisation and the outrider frames that launched it.

    python scripts/trace_compiles.py outrider.bench spec --model outrider/demo/target --spec-type mtp --batch 8
"""

from __future__ import annotations

import runpy
import sys
import time
import traceback

from triton import knobs

_started: dict[object, float] = {}


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/outrider/" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/outrider/', 1)[1]}:{f.lineno} {f.name}" for f in reversed(frames[-5:]))


def _before(*, key, fn, compile, **_) -> bool:
    _started[id(key)] = time.perf_counter()
    return False  # compile it


def _after(*, key, fn, compile, **_) -> bool:
    seconds = time.perf_counter() - _started.pop(id(key), time.perf_counter())
    constants = {k[-1] if isinstance(k, tuple) else k: v for k, v in compile["constants"].items()}
    print(f"[compile] {fn.name} {seconds:.2f} s {constants} at {_where()}", file=sys.stderr, flush=True)
    return False


if __name__ == "__main__":
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = _before, _after
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
