"""One printed line per measurement: the numbers plus achieved bandwidth and % of the spec roofline."""

from __future__ import annotations

import json


class Reporter:
    def __init__(self, peak_bw: float | None, json_path: str | None = None) -> None:
        self.peak_bw = peak_bw
        self.json_path = json_path
        self.rows: list[dict] = []

    def line(self, label: str, text: str, bytes_moved: float, seconds: float, **fields) -> None:
        """Print `label: text | X TB/s = Y% of roofline`; bytes_moved over seconds is the achieved bandwidth."""
        bw = bytes_moved / seconds if seconds > 0 else 0.0
        roof = f" = {100 * bw / self.peak_bw:.0f}% of {self.peak_bw / 1e12:.2f} TB/s roofline" if self.peak_bw else ""
        self._add(f"{label}: {text} | {bw / 1e12:.2f} TB/s{roof}",
                  {"label": label, "bandwidth_Bps": bw, "roofline_Bps": self.peak_bw, **fields})

    def note(self, label: str, text: str, **fields) -> None:
        """Print `label: text`, a line with no bandwidth (e.g. a measurement that failed)."""
        self._add(f"{label}: {text}", {"label": label, **fields})

    def _add(self, printed: str, row: dict) -> None:
        print(printed, flush=True)
        self.rows.append(row)
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump(self.rows, f, indent=1)
