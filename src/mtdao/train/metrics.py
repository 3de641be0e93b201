"""Run outputs: metrics as JSON lines (and TensorBoard when installed), results.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool = True, append: bool = False) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tensorboard = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            self.path.write_text("")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:  # tensorboard is optional
            self._tensorboard = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._tensorboard is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run rewrites them)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(path: Path, value: Any) -> None:
    path = Path(path)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(value, indent=2))
    partial.replace(path)
