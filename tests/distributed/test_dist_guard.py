"""Multi-process start-up checks: a rank that cannot see the run folder rank 0 writes fails at once."""

from __future__ import annotations

import socket

from dist_helpers import COMMON, TINY, torchrun_cli_many


def test_rank_that_cannot_see_the_run_folder_fails_at_start(tmp_path):
    # each rank its own folder: what a host that does not mount the shared run folder sees
    err = torchrun_cli_many(2, tmp_path, [["train", *COMMON, *TINY, "--max_steps", "2", "--outputs",
                                           str(tmp_path / "rank{RANK}")]], fails=(0,))[0]
    host = socket.gethostname()
    for r in (0, 1):  # every rank says it
        assert (f"ditforge train: error: --outputs {tmp_path / f'rank{r}'}: rank 1 on {host} cannot see the folder "
                f"that rank 0 on {host} writes; every host must reach the run folder at the same path on a shared "
                "file system") in err, err[-3000:]
    assert not (tmp_path / "rank0" / "checkpoints").exists() and not (tmp_path / "rank0" / "metrics.jsonl").exists()
