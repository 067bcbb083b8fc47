"""Fault injection for the liveness tests: a prompt holding a chosen token id breaks the target's forward.

Off unless the server's environment names the tokens, as JSON in OUTRIDER_TEST_FAULTS, e.g.
`{"request_fault_token": 7, "fatal_fault_token": 8, "stall_token": 9, "stall_s": 3}`:
- request fault: a RuntimeError in the forward, a fault of that request (the engine fails it alone);
- fatal fault: torch.AcceleratorError, what a lost device raises (the engine cannot go on);
- stall: the forward sleeps `stall_s` seconds (the engine loop makes no progress meanwhile).
`step_delay_s` makes every forward that long (a slow model: tests keep requests in flight for a known time).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

ENV = "OUTRIDER_TEST_FAULTS"


@dataclass(frozen=True)
class FaultPlan:
    request_fault_token: int | None = None
    fatal_fault_token: int | None = None
    stall_token: int | None = None
    stall_s: float = 0.0
    step_delay_s: float = 0.0

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        raw = os.environ.get(ENV)
        return cls(**json.loads(raw)) if raw else None

    def install(self, model: nn.Module) -> None:
        """Check every forward's input ids (a torch pre-hook: the engine's code stays as it is)."""
        model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, _: nn.Module, args: tuple) -> None:
        time.sleep(self.step_delay_s)
        ids = set(args[0].tolist())
        if self.stall_token in ids:
            time.sleep(self.stall_s)
        if self.request_fault_token in ids:
            raise RuntimeError(f"injected fault: token {self.request_fault_token} breaks the forward")
        if self.fatal_fault_token in ids:
            raise torch.AcceleratorError(f"injected fault: token {self.fatal_fault_token} lost the device")
