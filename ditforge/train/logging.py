"""Run logging: metrics as JSON lines (``RUN/metrics.jsonl``), one object per logged step, and the same
records plus the sample grids in TensorBoard (``RUN/tensorboard/``) or Weights & Biases (``Tracker``)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from ditforge.atomic import atomic_path
from ditforge.config.values import report_backends

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON object per line to ``path``, each line in unbuffered writes, so a crash loses nothing
    logged. A line that cannot be written whole (a full disk) is cut off again before the error is raised: the
    file holds whole lines only, and nothing is left in a buffer for ``close`` to write."""

    def __init__(self, path: Path):
        self.file = open(path, "ab", buffering=0)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (non-finite floats as null).

        Raises:
            OSError: the line could not be written (the file is as it was).
        """
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        line = (json.dumps(clean) + "\n").encode()
        end = self.file.seek(0, os.SEEK_END)
        try:
            done = 0
            while done < len(line):  # a raw write may be short; the next one says why
                done += self.file.write(line[done:])
        except OSError:
            self.file.truncate(end)
            raise

    def close(self) -> None:
        self.file.close()


class Tracker:
    """Experiment tracking beside ``metrics.jsonl`` (the trainer's process 0): TensorBoard event files in
    ``RUN/tensorboard/`` (``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package)
    and/or a Weights & Biases run, as ``--report_to`` chooses (``ditforge.config.values.report_backends``). Every call
    is flushed at once, as ``MetricsLog`` is, so a crash loses nothing logged. With neither tracker every call
    does nothing.

    Args:
        run_dir: the run folder.
        report_to: ``--report_to``: tensorboard | wandb | all | none | auto.
        config: the resolved run config (``RunConfig.to_dict()``), W&B's run config.
        resumed_at: the step a resumed run starts from: TensorBoard hides the events of later steps that the
            interrupted run logged after its checkpoint, as ``metrics.jsonl`` is truncated there.

    Raises:
        UserError: ``report_backends``'s (a named tracker that is not installed).
    """

    def __init__(self, run_dir: Path, report_to: str, config: dict, resumed_at: int | None = None):
        backends = report_backends(report_to)
        if report_to == "auto" and not backends:
            log.info("--report_to auto: tensorboard is not installed, metrics go to metrics.jsonl alone "
                     "(pip install 'ditforge[tensorboard]')")
        self.tb = self.wandb = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"),
                                    purge_step=None if resumed_at is None else resumed_at + 1)
        if "wandb" in backends:
            import wandb

            self.wandb = wandb.init(project="ditforge", name=Path(run_dir).name, dir=str(run_dir), config=config)

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Every finite number of ``record`` (a ``metrics.jsonl`` record: loss terms, lr, grad_norm,
        samples_per_sec, peak_memory_gib, and MFU or eval metrics when it has them) as a scalar of its name."""
        scalars = {k: float(v) for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def image(self, step: int, path: Path, tag: str = "samples") -> None:
        """A sample grid the trainer wrote: a PNG, or an animated GIF (video runs). TensorBoard gets the file's
        bytes as they are in an image summary (it shows GIFs animated; ``add_video`` would need moviepy to
        encode one), W&B an Image or a Video."""
        path = Path(path)
        if self.tb is not None:
            from PIL import Image
            from tensorboard.compat.proto.summary_pb2 import Summary

            with Image.open(path) as img:
                (width, height), channels = img.size, len(img.getbands())
            picture = Summary.Image(height=height, width=width, colorspace=channels,
                                    encoded_image_string=path.read_bytes())
            self.tb.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=picture)]), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Video(str(path)) if path.suffix == ".gif" else wandb.Image(str(path))},
                           step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def progress_line(step: int, max_steps: int, loss: float, steps_per_sec: float, peak_gib: float | None) -> str:
    """The trainer's log line per ``--log_every`` steps when stderr is no terminal (a file under nohup, a Slurm
    log), where tqdm's bar turns itself off: ``step 120/1000 | loss 0.1234 | 2.50 steps/s | ETA 0:05:52`` and, on a
    GPU, ``| peak 12.34 GiB`` (``torch.cuda.max_memory_allocated``). The ETA is the steps left at the window's
    rate, in H:MM:SS."""
    import datetime

    eta = (max_steps - step) / steps_per_sec if steps_per_sec > 0 else math.inf
    parts = [f"step {step}/{max_steps}", f"loss {loss:.4f}", f"{steps_per_sec:.2f} steps/s",
             f"ETA {datetime.timedelta(seconds=round(eta)) if math.isfinite(eta) else '?'}"]
    if peak_gib is not None:
        parts.append(f"peak {peak_gib:.2f} GiB")
    return " | ".join(parts)


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def rewrite_metrics(path: Path, records: list[dict]) -> None:
    """``metrics.jsonl`` rewritten atomically to ``records``: a resumed run's records end at its checkpoint."""
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))


def mean_records(records: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the records that have it (a log window's: the generator's keys only in its steps)."""
    keys = {k for r in records for k in r}
    return {k: sum(r[k] for r in records if k in r) / sum(k in r for r in records) for k in sorted(keys)}
