"""A training run's output as a device run may return it: tar files of at most 16 MiB, plus plain copies of its
metrics and log, rewritten after every stage so that a run stopped from outside returns what it finished."""

from __future__ import annotations

import tarfile
from pathlib import Path

PACK_FILE_LIMIT = 16 << 20


def pack(out: Path, dest: Path, parts: dict[str, tuple[str, ...]]) -> list[Path]:
    """Write `parts` (tar file name -> members, paths under `out`) of `out` into `dest`, and plain
    copies of metrics.json and train_log.txt to read without unpacking. Members not written yet are left out (a
    part with none is skipped), and each file replaces its previous version in one rename, so a run killed while
    packing leaves the last complete pack. Raises if a part is over PACK_FILE_LIMIT."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, members in parts.items():
        present = [m for m in members if (out / m).exists()]
        if present:
            with tarfile.open(dest / f".{name}.partial", "w") as tar:
                for member in present:
                    tar.add(out / member, arcname=member)
            written.append((dest / f".{name}.partial").replace(dest / name))
    for name in ("metrics.json", "train_log.txt"):
        (dest / f".{name}.partial").write_bytes((out / name).read_bytes())
        written.append((dest / f".{name}.partial").replace(dest / name))
    too_big = [f"{p.name}: {p.stat().st_size} bytes" for p in written if p.stat().st_size > PACK_FILE_LIMIT]
    if too_big:
        raise RuntimeError(f"over the {PACK_FILE_LIMIT} bytes a returned file may have: {', '.join(too_big)}")
    return written
