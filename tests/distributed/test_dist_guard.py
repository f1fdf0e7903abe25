"""Multi-process start-up checks: a rank that cannot see the run folder rank 0 writes fails at once."""

from __future__ import annotations

import socket
import subprocess
import sys

from dist_helpers import COMMON, TINY, dist_env

LAUNCH = """
import os, sys
from ditforge.cli import main
# Each rank its own folder: what a host that does not mount the shared run folder sees.
sys.exit(main(["train", *sys.argv[2:], "--outputs", os.path.join(sys.argv[1], "rank" + os.environ["RANK"])]))
"""


def test_rank_that_cannot_see_the_run_folder_fails_at_start(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(LAUNCH)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(script), str(tmp_path), *COMMON, *TINY, "--max_steps", "2"],
                       env=dist_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    host = socket.gethostname()
    for r in (0, 1):  # every rank says it (their lines may interleave in torchrun's stderr)
        assert (f"ditforge train: error: --outputs {tmp_path / f'rank{r}'}: rank 1 on {host} cannot see the folder "
                f"that rank 0 on {host} writes; every host must reach the run folder at the same path on a shared "
                "file system") in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "rank0" / "checkpoints").exists() and not (tmp_path / "rank0" / "metrics.jsonl").exists()
