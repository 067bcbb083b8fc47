"""Models on the Hugging Face hub, found as llama-server's `-hf user/repo[:QUANT]` finds them.

A repo with GGUF files gives the one for the quant tag (Q4_K_M when no tag is given and it has one, else its
first GGUF), every part of a split one; a repo without gives its safetensors snapshot, as before. Offline, or when
the hub cannot be reached, the local hub cache answers, or the error says what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from outrider.models import gguf, torch_weights

DEFAULT_QUANT = "Q4_K_M"
_SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]  # config, weights, tokenizer


@dataclass(frozen=True)
class RepoFiles:
    """A repo's file names, from the hub or, when `cached` is set, from that snapshot of the local cache."""

    names: tuple[str, ...]
    cached: Path | None


def resolve_hub_model(spec: str, offline: bool = False, filename: str | None = None) -> Path:
    """The local path of `user/repo[:QUANT]`'s model: a GGUF file (downloaded unless cached) or a snapshot
    directory. `filename` (llama-server's --hf-file) names the GGUF file instead of the quant tag."""
    repo, _, quant = spec.partition(":")
    files = _repo_files(repo, offline)
    choice = filename or pick_gguf(repo, files.names, quant)
    if choice is None:
        return _snapshot(repo, offline, snapshot_patterns(files.names))
    parts = gguf.split_names(choice)
    missing = [p for p in parts if p not in files.names]
    if missing:
        where = "the local hub cache of " if files.cached else ""
        raise ValueError(f"{', '.join(missing)} not found in {where}{repo}")
    if files.cached:
        return files.cached / parts[0]
    from huggingface_hub import hf_hub_download

    return Path([hf_hub_download(repo, p) for p in parts][0])


def pick_gguf(repo: str, names: tuple[str, ...], quant: str) -> str | None:
    """The GGUF model among `names` whose name carries the quant tag (case-insensitive, between - . or /);
    no tag: Q4_K_M if there is one, else the first. None when the repo has no GGUF models."""
    models = gguf.model_files(list(names))
    tagged = [m for m in models if (quant or DEFAULT_QUANT).upper() in re.split(r"[-./]", m.upper())]
    if tagged:
        return tagged[0]
    if quant:
        have = ", ".join(models) if models else "no GGUF files"
        raise ValueError(f"{repo} has no GGUF file for quant {quant!r} (it has {have})")
    return models[0] if models else None


def _repo_files(repo: str, offline: bool) -> RepoFiles:
    """The repo's files from the hub; from the cache when offline, or when the hub cannot be reached."""
    from huggingface_hub import HfApi, snapshot_download

    hub_error = None
    if not offline:
        try:
            return RepoFiles(tuple(HfApi().list_repo_files(repo)), None)
        except Exception as e:  # offline mode, no network, hub down... the cache may still have it
            hub_error = e
    try:
        snapshot = Path(snapshot_download(repo, local_files_only=True))
    except Exception as e:  # hub errors are many types; the caller wants one clear message
        why = f"the hub said: {hub_error}" if hub_error else "offline: only the local hub cache is read"
        raise ValueError(f"cannot find model {repo!r}: not in the local hub cache ({why})") from e
    names = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())
    return RepoFiles(tuple(names), snapshot)


def snapshot_patterns(names: tuple[str, ...]) -> list[str]:
    """The files of a snapshot to fetch: config, tokenizer and safetensors weights, or, in a repo without
    safetensors, its torch.save weights (pytorch_model.bin, .pth, .pt: read safely, models/torch_weights.py)."""
    if any(n.endswith(".safetensors") for n in names):
        return _SNAPSHOT_FILES
    return [*_SNAPSHOT_FILES, *torch_weights.PATTERNS]


def _snapshot(repo: str, offline: bool, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=offline))
    except Exception as e:  # hub errors are many types; the caller wants one clear message
        raise ValueError(f"cannot find model {repo!r} locally or on the Hugging Face hub: {e}") from e
