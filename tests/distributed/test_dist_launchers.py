"""The many-node launchers of docs/multi-gpu.md ("Many nodes"), run and read by the parsers that will read them.

The Slurm script runs under bash with stand-ins on PATH, written into the test's folder: ``scontrol`` prints the
allocation's host names, ``srun`` runs its command once per node (``SLURM_NODEID``, ``SLURM_PROCID`` and
``SLURMD_NODENAME`` set, as Slurm does for one task per node), and ``torchrun`` records its argv and environment as
JSON. What torchrun received is then parsed by torch's own parser (``torch.distributed.run.get_args_parser``), and
its ditforge part by ditforge's (``cli.build_parser``, then ``build_config`` as ``ditforge train`` does): a flag that
either does not know, or a value it refuses, fails here. The plain torchrun line is parsed the same way. No ditforge
or torch process is started; the host names and the job id are drawn afresh each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ditforge.cli import build_parser
from ditforge.config.load import build_config
from ditforge.errors import UserError

DOC = Path(__file__).resolve().parents[2] / "docs" / "multi-gpu.md"
PORT = "29500"

SCONTROL = """#!/bin/bash
if [ "$#" -ne 3 ] || [ "$1 $2" != "show hostnames" ] || [ "$3" != "$SLURM_JOB_NODELIST" ]; then
    echo "scontrol stand-in: expected show hostnames \\"\\$SLURM_JOB_NODELIST\\", got: $*" >&2; exit 2
fi
printf '%s\\n' $SHIM_HOSTS
"""
# srun's own options (in the --name=value form) are recorded; the first word that is not one starts the command
SRUN = """#!/bin/bash
while [ "${1#-}" != "$1" ]; do printf '%s\\n' "$1" >> "$SHIM_RECORD/srun-options"; shift; done
node=0
for host in $SHIM_HOSTS; do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURMD_NODENAME=$host "$@" || exit $?
    node=$((node + 1))
done
"""
TORCHRUN = """#!{python}
import json, os, sys
with open(os.path.join(os.environ["SHIM_RECORD"], "torchrun-" + os.environ["SLURM_NODEID"] + ".json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""


def many_nodes_blocks() -> tuple[str, str]:
    """(the sbatch script, the plain torchrun line): the fenced bash blocks of the "## Many nodes" section."""
    text = DOC.read_text()
    start = text.index("\n## Many nodes\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"^```bash\n(.*?)^```", text[start:end if end >= 0 else None], re.S | re.M)
    scripts = [b for b in blocks if b.startswith("#!/bin/bash\n")]
    lines = [b for b in blocks if not b.startswith("#!")]
    assert len(scripts) == 1 and len(lines) == 1, f"expected one sbatch script and one torchrun line, got {blocks}"
    return scripts[0], lines[0]


def sbatch_directives(script: str) -> argparse.Namespace:
    """The ``#SBATCH`` options, read as sbatch reads them: from the lines before the first command."""
    options, seen = [], 0
    for line in script.splitlines()[1:]:
        line = line.strip()
        if line.startswith("#SBATCH"):
            options += shlex.split(line.removeprefix("#SBATCH"), comments=True)
            seen += 1
        elif line and not line.startswith("#"):
            break
    assert seen == script.count("#SBATCH"), "an #SBATCH line after the first command is ignored by sbatch"
    parser = argparse.ArgumentParser(prog="#SBATCH", exit_on_error=False)
    for name in ("--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task"):
        parser.add_argument(name, type=int, required=True)
    parsed, rest = parser.parse_known_args(options)
    assert all(re.fullmatch(r"--[a-z-]+=\S+", o) for o in rest), f"directives not of the --name=value form: {rest}"
    return parsed


def torchrun_args(argv: list[str], monkeypatch) -> argparse.Namespace:
    """``argv`` as torchrun reads it (its parser's defaults come from PET_* variables: none here)."""
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(argv)


def ditforge_config(args: argparse.Namespace):
    """The run config ``ditforge train`` makes of torchrun's script arguments (unknown flags and bad values fail)."""
    assert args.module and args.training_script == "ditforge", "expected torchrun -m ditforge"
    assert args.training_script_args[:1] == ["train"], args.training_script_args
    flags = vars(build_parser().parse_args(args.training_script_args))
    assert flags.pop("command") == "train"
    return build_config(flags.pop("config", None), flags)


def check_run(args: argparse.Namespace, nnodes: int) -> None:
    """What both launchers promise: c10d rendezvous on port 29500, 3 restarts, hsdp over one node's processes,
    resuming from the newest checkpoint, the collective timeout, and a global batch that splits over the world."""
    assert (args.rdzv_backend, args.rdzv_endpoint.rsplit(":", 1)[1], args.max_restarts) == ("c10d", PORT, 3)
    cfg = ditforge_config(args)
    p = cfg.parallel
    assert (p.plugin, p.dp_shard, p.dp_replicate) == ("hsdp", int(args.nproc_per_node), 0), p
    assert (cfg.train.resume, p.collective_timeout) == ("auto", 600), (cfg.train.resume, p.collective_timeout)
    assert cfg.train.outputs.startswith("/shared/") and cfg.data.data.startswith("/shared/"), "a shared file system"
    assert cfg.train.batch_size % (nnodes * int(args.nproc_per_node)) == 0, cfg.train.batch_size


def run_sbatch_script(script: str, tmp_path: Path, hosts: list[str], job_id: str,
                      cpus: int) -> tuple[list[dict], list[str]]:
    """Run ``script`` as sbatch would on an allocation of ``hosts``, with the stand-ins: what torchrun received,
    node by node ({"argv", "env"}), and srun's options."""
    shims, record = tmp_path / "bin", tmp_path / "record"
    shims.mkdir()
    record.mkdir()
    for name, body in (("scontrol", SCONTROL), ("srun", SRUN), ("torchrun", TORCHRUN.format(python=sys.executable))):
        (shims / name).write_text(body)
        (shims / name).chmod(0o755)
    env = {"PATH": f"{shims}:{os.environ['PATH']}", "HOME": str(tmp_path), "SHIM_HOSTS": " ".join(hosts),
           "SHIM_RECORD": str(record), "SLURM_JOB_NODELIST": ",".join(hosts), "SLURM_NNODES": str(len(hosts)),
           "SLURM_JOB_ID": job_id, "SLURM_CPUS_PER_TASK": str(cpus)}
    (tmp_path / "train.sh").write_text(script)
    done = subprocess.run(["bash", str(tmp_path / "train.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = sorted(record.glob("torchrun-*.json"))
    assert [p.name for p in runs] == [f"torchrun-{i}.json" for i in range(len(hosts))], "one torchrun per node"
    srun = (record / "srun-options").read_text().split()
    return [json.loads(p.read_text()) for p in runs], srun


def test_slurm_script(tmp_path, monkeypatch):
    script, _ = many_nodes_blocks()
    directives = sbatch_directives(script)
    assert directives.nodes >= 2 and directives.ntasks_per_node == 1 and directives.gpus_per_node == 8, directives
    rng = random.Random(os.urandom(8))
    hosts = [f"gpu-{rng.choice('abcdefgh')}{n:03d}" for n in rng.sample(range(1000), 2)]
    job_id = str(rng.randrange(10**5, 10**7))
    runs, srun = run_sbatch_script(script, tmp_path, hosts, job_id, directives.cpus_per_task)
    assert runs[0]["argv"] == runs[1]["argv"], "every node must run the same torchrun command"
    srun_parser = argparse.ArgumentParser(prog="srun", exit_on_error=False)
    srun_parser.add_argument("--cpus-per-task", type=int, required=True)
    assert srun_parser.parse_known_args(srun)[0].cpus_per_task == directives.cpus_per_task, srun
    for run in runs:
        assert run["env"].get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1", "each rendezvous round's own store"
        args = torchrun_args(run["argv"], monkeypatch)
        assert (args.nnodes, args.nproc_per_node) == ("2", str(directives.gpus_per_node)), args
        assert (args.rdzv_endpoint, args.rdzv_id) == (f"{hosts[0]}:{PORT}", job_id), args
        check_run(args, nnodes=directives.nodes)  # the batch splits over the documented allocation


def shell_words(block: str) -> tuple[dict[str, str], list[str]]:
    """A one-command bash block as the shell splits it: its leading NAME=value assignments, then its words."""
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def test_plain_torchrun_line(monkeypatch):
    script, line = many_nodes_blocks()
    env, words = shell_words(line)
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} and words[0] == "torchrun", (env, words[:1])
    args = torchrun_args(words[1:], monkeypatch)
    assert (args.rdzv_endpoint, args.rdzv_id, args.nproc_per_node) == (f"HOST0:{PORT}", "RUN_ID", "8"), args
    check_run(args, nnodes=int(args.nnodes))
    # the same run as the Slurm script's, and the hosts line at the top of the page the same launch
    (slurm,) = [w for w in commands(script) if w[:1] == ["srun"]]
    assert args.training_script_args == slurm[slurm.index("-m") + 2:], "the Slurm script trains another run"
    top = DOC.read_text().split("\n## ", 1)[0]
    hosts_line = [w for w in torchrun_commands(top) if "--nnodes" in w]
    assert len(hosts_line) == 1, hosts_line
    top_args = torchrun_args(hosts_line[0][1:], monkeypatch)
    assert (top_args.nnodes, top_args.nproc_per_node, top_args.rdzv_backend, top_args.rdzv_endpoint) == (
        args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint), top_args
    flags = top_args.training_script_args
    assert flags[:1] == ["train"] and flags[flags.index("--plugin") + 1] == "hsdp", flags


def commands(block: str) -> list[list[str]]:
    """The words of each command of a bash block, one command per line once continuations are joined."""
    return [w for line in block.replace("\\\n", " ").splitlines() if (w := shlex.split(line, comments=True))]


def torchrun_commands(text: str) -> list[list[str]]:
    """The words of every torchrun command in the bash blocks of ``text``."""
    return [w for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M) for w in commands(block)
            if w[:1] == ["torchrun"]]


@pytest.mark.parametrize("flag", ["--no_such_flag", "--plugin hsdpp", "--collective_timeout 0"])
def test_a_wrong_ditforge_flag_fails(monkeypatch, flag):
    """The check can fail: the plain line with a flag ditforge does not know, or a value it refuses."""
    _, line = many_nodes_blocks()
    _, words = shell_words(line)
    args = torchrun_args([*words[1:], *flag.split()], monkeypatch)
    with pytest.raises((SystemExit, UserError)):
        ditforge_config(args)
