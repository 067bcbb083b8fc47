#!/usr/bin/env bash
# A committed revision as a plain tree for the device: `scripts/snapshot.sh REV DIR` writes REV's outrider/,
# tests/, scripts/ and pyproject.toml to DIR (demo weights left out), to send with `carry: [DIR]` and run from
# there (`cd DIR && PYTHONPATH=$PWD ...`). Two snapshots in one call give a same-machine A/B, which matters:
# batch-1 numbers move by up to ~15% between freshly started machines. Never run git on the device: the .git
# that travels there is stale, and a checkout there restores old code (docs/benchmarks.md, run F).
set -euo pipefail
rev=$1 dir=$2
case "$dir" in .snap*) ;; *) echo "snapshot.sh: the tree goes to a .snap* directory (it is emptied first)" >&2; exit 2 ;; esac
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" outrider tests scripts pyproject.toml | tar -x -C "$dir"
find "$dir" -name '*.safetensors' -delete
echo "$dir: $(git rev-parse --short "$rev"), $(du -sh "$dir" | cut -f1)"
