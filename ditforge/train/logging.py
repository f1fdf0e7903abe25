"""Run logging: metrics as JSON lines (``RUN/metrics.jsonl``), one object per logged step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per call to ``path``; flushed at once so a crash loses nothing logged."""

    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        self.file.close()


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
