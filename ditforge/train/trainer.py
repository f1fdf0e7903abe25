"""The training run and its control: ``train`` builds the run phase by phase (``train.build``), resumes it,
then runs the loop (``train.step``'s step, then the metrics, evaluation, sample grids and checkpoints due),
rolls back a loss spike, turns Ctrl-C / SIGTERM into a checkpoint and finishes.
"""

from __future__ import annotations

from collections.abc import Callable

import contextlib
import functools
import logging
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ditforge.config.sections import RunConfig, freeze
from ditforge.encoders.batch import as_batch
from ditforge.errors import RunError, UserError
from ditforge.parallel.collectives import mean_over_processes
from ditforge.parallel.context import refuse_unsplittable
from ditforge.optim.library import set_lr
from ditforge.optim.placement import keep_states_within, out_of_memory
from ditforge.optim.skip import settle_skip
from ditforge.parallel.heartbeat import Heartbeat, group_timeout
from ditforge.parallel.mesh import Dist, hsdp_replicas, init_distributed, shutdown
from ditforge.train import checkpoint as ckpt_io
from ditforge.train.build import (Run, build_data, build_ema_and_optimizer, build_loader, build_model,
                                  last_checkpoint, load_init, open_logs, open_outputs, open_run,
                                  truncate_metrics)
from ditforge.train.guard import LossSpikeGuard, all_finite
from ditforge.train.logging import MetricsLog, progress_line
from ditforge.train.previews import evaluate, write_samples
from ditforge.train.resolve import pipeline_family, resolve
from ditforge.train.step import ema_decay_at, learning_rate, make_micro_batches, train_step
from ditforge.train.validation import read_validation_prompts
from ditforge.weights import read as weights_io

log = logging.getLogger(__name__)


def train(cfg: RunConfig, class_clips: Callable | None = None) -> Path:
    """Train a DiT as configured, in this process or as one of torchrun's; returns the run folder.
    ``class_clips``: the function that draws a video pipeline's missing DreamBooth class clips
    (``sample.class_clips.draw_class_clips``, which ``cli`` passes: this layer does not import sampling); None: a
    ``--class_data`` folder of a video run must hold them all.

    Writes (rank 0) ``config.yaml``, ``metrics.jsonl`` (step, loss, mse, vb, lr, grad_norm, samples_per_sec,
    ...), ``samples/step-*.png`` and ``checkpoints/step-*/`` (every rank its shards); a checkpoint is saved
    every ``ckpt_every`` steps, at the end, and on Ctrl-C or SIGTERM (then KeyboardInterrupt is re-raised).

    Raises:
        UserError: bad data, model, parallelism or checkpoint settings.
    """
    if cfg.train.gpu_memory_budget is not None:
        # Under a cap the caching allocator's fixed-size segments fragment (a free 300 MB that no 350 MB request
        # fits is lost to the budget); segments that grow in place do not. Read when CUDA first allocates.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sp = cfg.parallel.sequence_parallel_size
    if sp > 1 and (family := pipeline_family(cfg)) is not None:  # before any process group or run folder
        refuse_unsplittable(family, sp, "shard it with --plugin fsdp instead", use="train")
    # the file's syntax before any process group, run folder or pipeline; resolve fits it to the pipeline
    samples = read_validation_prompts(cfg.train.validation_prompts) if cfg.train.validation_prompts else None
    par = cfg.parallel
    replicate = 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if par.plugin != "hsdp" and (par.dp_shard or par.dp_replicate):
        raise UserError(f"--dp_shard / --dp_replicate: the layout of --plugin hsdp, got --plugin {par.plugin}")
    if par.plugin == "hsdp" and world > 1:  # before any process group: a layout that does not fit is bad input
        # (one process: hsdp resolves to none, as a resumed hsdp checkpoint does)
        replicate = hsdp_replicas(par.dp_shard, par.dp_replicate, world,
                                  int(os.environ.get("LOCAL_WORLD_SIZE", world)), sp, par.tensor_parallel)
    d = init_distributed(cfg.train.device, sp,
                         group_of_one=cfg.train.cpu_offload == "all",  # FSDP2 offloads, even in one process
                         tensor_parallel_size=par.tensor_parallel, dp_replicate=replicate,
                         collective_timeout=group_timeout(par.collective_timeout))
    # every process beats; a collective that fails or hangs on a lost peer ends the run naming it
    heartbeat = Heartbeat(d, par.collective_timeout) if d.world_size > 1 else None
    lost = None
    try:
        with contextlib.ExitStack() as held:
            return _train(cfg, d, held, samples, class_clips, heartbeat)
    except RuntimeError as e:  # torch.distributed's errors among them: is a peer gone?
        if heartbeat is None or (lost := heartbeat.describe()) is None:
            raise
        raise RunError(lost) from e
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if lost is None:  # with a peer gone, leaving the group could wait on it: the process ends anyway
            shutdown(d)


def _train(cfg: RunConfig, d: Dist, held: contextlib.ExitStack, samples: list | None,
           class_clips: Callable | None = None, heartbeat: Heartbeat | None = None) -> Path:
    """The run's phases, in order; each fills its part of the state they share (``Run``). The phases up to the
    data open things and report what they found; the settings are resolved and written once (``resolve``), then
    frozen before the model is built: no phase after writes the config."""
    run = open_run(cfg, d, held)
    run.validation, run.class_clips, run.heartbeat = samples, class_clips, heartbeat
    load_init(run)
    build_data(run)
    freeze(resolve(run))
    build_model(run)
    build_ema_and_optimizer(run)
    _resume(run)
    open_outputs(run)
    build_loader(run)
    open_logs(run)
    return _finish(run, _loop(run))


def _save(run: Run, step: int) -> Path | None:
    """Save step ``step`` unless its weights are not finite (RunError); a failed write is a RunError too, or
    with --continue_on_save_error a warning (returns None)."""
    model, ema, d = run.model, run.ema, run.d
    run.nonfinite.flush()
    weights = [p for p in model.parameters() if p.requires_grad] + [ema.shadow[k] for k in ema.trainable]
    if not all_finite(weights, d):
        raise RunError(f"step {step}: the weights hold NaN or inf; not saved (the last good checkpoint is "
                       f"{run.last_good()}); lower --lr, add --warmup_steps or keep --max_grad_norm")
    meta = {"config": run.cfg.to_dict(), "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "step_in_backward": run.stepper.state_dict() if run.stepper is not None else None,
            "world_size": d.world_size, "plugin": run.cfg.parallel.plugin,
            "loader": (run.shard_loader.state_dict(step + run.data_offset, run.checkpointer.group)
                       if run.shard_loader is not None else None),
            "data_offset": run.data_offset,
            "loss_spike": run.spikes.state_dict(d) if run.spikes is not None else None}
    with run.written(f"checkpoint step-{step:07d}"):
        return run.checkpointer.save(step, ckpt_io.training_state(model, run.optimizer, ema, run.adapters_only),
                                      meta)
    return None


def _finish_saves(run: Run) -> None:
    with run.written("checkpoint"):
        run.checkpointer.wait()


def _update_ema(run: Run, step: int, skipped: torch.Tensor) -> None:
    decay = run.cfg.train.ema_decay
    if skipped.device.type == "cpu":  # known on the host already
        if not skipped:
            run.ema.update(run.model, ema_decay_at(decay, step))
    else:
        run.ema.update(run.model, ema_decay_at(decay, step), skip=skipped)


def _resume(run: Run) -> None:
    """The loss-spike guard (--loss_spike_factor); --resume: the weights, optimizer, EMA, grad scaler,
    step-in-backward and loss-spike guard states of ``run.resume_from``, its step, data offset and shard loader's
    position."""
    resume_from, t = run.resume_from, run.cfg.train
    if t.loss_spike_factor is not None:  # a partial, not run.last_good (see open_logs)
        run.spikes = LossSpikeGuard(t.loss_spike_factor, t.loss_spike_window, t.max_loss_spike_rollbacks,
                                    run.d.device, functools.partial(last_checkpoint, run.run_dir))
    if resume_from is None:
        return
    saved = bool(weights_io.read_meta(resume_from).get("config", {}).get("train", {}).get("delayed_update"))
    if saved != t.delayed_update:  # its optimizer state holds the masters, one update ahead of the weights
        raise UserError(f"--resume {resume_from}: saved {'with' if saved else 'without'} --delayed_update; "
                        f"resume it {'with' if saved else 'without'} the flag")
    meta = _load_checkpoint(run, resume_from)
    run.start_step, run.loader_state = int(meta["step"]), meta.get("loader")
    run.data_offset = meta.get("data_offset", 0)  # kept with the guard off: the skipped batches stay skipped
    if run.spikes is not None:
        run.spikes.load_state_dict(meta.get("loss_spike"), run.d)
    if run.d.is_main:
        log.info("resumed from %s at step %d (saved by %s processes, plugin %s)", resume_from, run.start_step,
                 meta.get("world_size", 1), meta.get("plugin", "none"))


def _load_checkpoint(run: Run, ckpt: Path) -> dict:
    """The weights, optimizer, EMA, grad scaler and step-in-backward states of ``ckpt`` into the run's; returns
    its meta (``ckpt_io.load_training_state``'s errors)."""
    meta = ckpt_io.load_training_state(ckpt, run.model, run.optimizer, run.ema, run.adapters_only)
    if run.scaler is not None and meta.get("scaler"):
        run.scaler.load_state_dict(meta["scaler"])
    if run.stepper is not None and meta.get("step_in_backward"):
        run.stepper.load_state_dict(meta["step_in_backward"])
    return meta


def _loop(run: Run) -> int:
    """The training loop, from ``run.start_step`` to ``run.max_steps``; returns the step reached. The first Ctrl-C
    or SIGTERM ends it after the step in flight with a checkpoint, then KeyboardInterrupt is re-raised; on a
    RunError a background save of good weights completes first."""
    t, d = run.cfg.train, run.d
    step, stepped = run.start_step, False
    # --gpu_memory_budget with streamed states: after two steps, as many states as the measured peak leaves room for
    # stay on the GPU (keep_states_within)
    measure_at = run.start_step + 2 if run.budget is not None and t.cpu_offload == "optimizer" else None
    window = _Window()
    # disable=None: off without a terminal on stderr, where _after_step logs a line per --log_every instead
    bar = tqdm(total=run.max_steps, initial=run.start_step, desc="train", dynamic_ncols=True,
               disable=None if d.is_main else True)
    interrupted = _DeferredInterrupt()
    # Its own gloo group: the checkpointer's may be busy in a background save's collectives.
    control_group = d.gloo_group()
    try:
        batches = iter(run.loader)
        while step < run.max_steps:
            if not interrupted.check(run.checkpointer.writing(), control_group) and run.checkpointer.pending:
                # a background save written on every rank is published now, not by the next save: a kill then
                # redoes at most --ckpt_every steps, not up to twice that
                _finish_saves(run)
            waited = time.perf_counter()
            batch = as_batch(next(batches))
            window.data_wait += time.perf_counter() - waited
            if run.experts is not None:  # this step's expert, and the objective of its side
                run.diffusion = run.experts.activate(t.seed, step + run.data_offset)
            micro, rows, samples = make_micro_batches(run, batch, step + run.data_offset)
            set_lr(run.optimizer, learning_rate(run.cfg, step))
            if run.ema_in_step:
                run.optimizer.ema_decay = ema_decay_at(t.ema_decay, step)
            try:
                out = train_step(run.model, run.objective_of(micro[0][0]), run.optimizer, run.scaler, micro,
                                 run.amp_dtype, t.max_grad_norm, d, rows, run.stepper, run.packing)
            except torch.OutOfMemoryError:
                raise out_of_memory(step, t.gpu_memory_budget, d.device) from None
            skipped, stepped = out.pop("skipped"), True
            run.checkpointer.wait_for_staging()  # a skipped fp16 step runs no pre-step hook; the EMA changes next
            _update_ema(run, step, skipped)
            run.nonfinite.push(step + 1, skipped, out["loss"], out["grad_norm"])  # reads the previous step's flag
            if run.spikes is not None:
                run.spikes.push(step, out["loss"], skipped)
            step, stepped = step + 1, False
            if step == measure_at:
                _keep_states_within_budget(run)
            window.add(out, skipped, samples)
            if run.heartbeat is not None:
                run.heartbeat.progress()
            bar.update(1)
            step = _after_step(run, step, window, bar)
    except KeyboardInterrupt:
        bar.close()
        if stepped:  # the optimizer already took this step: finish it, so the checkpoint is step-consistent
            _update_ema(run, step, skipped)
            step += 1
        path = _save(run, step)
        _finish_saves(run)
        log.warning("interrupted at step %d; checkpoint saved to %s", step, path)
        raise
    except RunError:
        with contextlib.suppress(RunError):
            _finish_saves(run)  # a background save of good weights still completes
        raise
    finally:
        interrupted.restore()
        if interrupted.pending and run.heartbeat is not None:  # a collective that fails now is the job ending
            run.heartbeat.stopped_by(interrupted.pending)
        if run.metrics is not None:
            run.metrics.close()
    bar.close()
    return step


def _keep_states_within_budget(run: Run) -> None:
    moved, peak = keep_states_within(run.optimizer, run.budget, run.d.device)
    if run.d.is_main:
        log.info("--gpu_memory_budget %s: peak %.2f GiB reserved over the first steps; %.2f GiB of "
                 "optimizer states moved to the GPU, the rest stream", run.cfg.train.gpu_memory_budget, peak / 2**30,
                 moved / 2**30)


class _Window:
    """The steps since the last metrics record: their summed values (a skipped step's left out), their count,
    their samples, and the time since the window opened and spent waiting for data."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.start, self.steps, self.samples, self.data_wait = time.perf_counter(), 0, 0, 0.0

    def add(self, out: dict[str, torch.Tensor], skipped: torch.Tensor, samples: int) -> None:
        self.steps, self.samples = self.steps + 1, self.samples + samples
        for k, v in out.items():  # a skipped step's values (NaN, inf) stay out of the means
            self.sums[k] = self.sums.get(k, 0) + torch.where(skipped, 0.0, v)
        self.sums["good_steps"] = self.sums.get("good_steps", 0) + (~skipped).double()

    def record(self, run: Run, step: int) -> dict[str, float]:
        """The window's metrics record at ``step``: means over its good steps and all processes (one all-reduce),
        lr, throughput, epoch, skipped steps, data-wait fraction and (CUDA) peak memory."""
        sums = mean_over_processes(self.sums, run.d)
        good = sums.pop("good_steps")  # the same on every process
        record = {k: v / good if good else math.nan for k, v in sums.items()}
        elapsed = time.perf_counter() - self.start
        record |= {"lr": learning_rate(run.cfg, step - 1), "samples_per_sec": self.samples / elapsed,
                   "epoch": step / max(run.steps_per_epoch, 1), "skipped_steps": self.steps - round(good),
                   "data_wait_fraction": self.data_wait / elapsed}
        if run.d.device.type == "cuda":
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.d.device) / 2**30
        return record


def _after_step(run: Run, step: int, window: _Window, bar: tqdm) -> int:
    """What follows step ``step`` (counted from 1) on its schedule: the loss-spike check and the metrics record
    (--log_every; with tqdm's bar off, no terminal on stderr, a ``progress_line`` logged too), the evaluation
    (--eval_every), the samples (--sample_every) and a checkpoint (--ckpt_every); the last step's samples and
    checkpoint are ``_finish``'s. Returns the step reached: ``step``, or after a
    loss spike the step rolled back to (``_roll_back``)."""
    t, max_steps = run.cfg.train, run.max_steps
    logs = step % t.log_every == 0 or step == max_steps
    spike = run.spikes.check(step, run.d) if run.spikes is not None and logs else None
    if spike is not None:
        step = _roll_back(run, step, *spike)
        window.reset()
        bar.n = step
        bar.refresh()
        return step
    metrics = run.metrics
    evaluated = evaluate(run) if t.eval_every and (step % t.eval_every == 0 or step == max_steps) else {}
    if evaluated and step % t.log_every and step != max_steps and metrics is not None:
        with run.written("metrics.jsonl"):  # between two log steps: a record of its own
            metrics.write({"step": step, **evaluated})
            run.tracker.log(step, evaluated)
    if logs:
        steps_per_sec = window.steps / max(time.perf_counter() - window.start, 1e-9)
        record = window.record(run, step) | evaluated
        if run.spikes is not None:
            record["rollbacks"] = run.spikes.rollbacks
        if metrics is not None:
            with run.written("metrics.jsonl"):
                metrics.write({"step": step, **record})
                run.tracker.log(step, record)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
        if bar.disable and run.d.is_main:  # no terminal: tqdm shows nothing, so a line per --log_every
            log.info(progress_line(step, max_steps, record["loss"], steps_per_sec, record.get("peak_memory_gib")))
        window.reset()
    if t.sample_every and step % t.sample_every == 0 and step < max_steps:
        write_samples(run, step)
    if step % t.ckpt_every == 0 and step < max_steps:
        _save(run, step)
    return step


def _roll_back(run: Run, step: int, mean: float, median: float) -> int:
    """A loss spike found after step ``step``: reload the newest checkpoint saved before the window that spiked
    (``run.spikes``), drop the checkpoints and metrics records after it (they belong to the abandoned steps), and
    skip the batches of the steps from it up to ``step``: the loader goes on where it is, so the data offset grows
    by those steps. Returns the checkpoint's step.

    Raises:
        RunError: no checkpoint was saved before the window.
    """
    d, window = run.d, run.spikes.window
    _finish_saves(run)
    run.nonfinite.flush()
    settle_skip(run.optimizer)  # before the checkpoint's states are loaded into the same tensors
    found = [None]  # rank 0 lists the folder (another rank may see a background save's rename late)
    if d.is_main:
        before = [p for p in weights_io.list_checkpoints(run.run_dir) if _step_of(p) <= step - window]
        found = [before[-1] if before else None]
    if d.mesh is not None:
        dist.broadcast_object_list(found, src=0)
    spike = (f"step {step}: mean loss {mean:.4g} over the last {window} steps is more than "
             f"{run.spikes.factor:g} x the median {median:.4g}")
    if found[0] is None:
        raise RunError(f"{spike}, and no checkpoint was saved before step {step - window + 1} to roll back to; "
                       "save more often (--ckpt_every) or keep more checkpoints (--keep_last)")
    ckpt, back = found[0], _step_of(found[0])
    if d.is_main:
        for later in weights_io.list_checkpoints(run.run_dir):
            if _step_of(later) > back:  # out of the listing first, as the checkpointer drops old ones
                doomed = later.with_name(f".tmp-delete-{later.name}")
                os.replace(later, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        run.metrics.close()
        truncate_metrics(run.run_dir / "metrics.jsonl", back)
        run.metrics = MetricsLog(run.run_dir / "metrics.jsonl")
    d.barrier()
    meta = _load_checkpoint(run, ckpt)
    run.checkpointer.last_step = back
    run.data_offset += step - back
    run.spikes.rolled_back(meta.get("loss_spike"), d)
    if d.is_main:
        log.warning("%s: rolled back to %s, skipping the batches of steps %d-%d (rollback %d in a row, %d in all)",
                    spike, ckpt.name, back + 1, step, run.spikes.in_row, run.spikes.rollbacks)
    return back


def _step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("-")[1])


def _finish(run: Run, step: int) -> Path:
    """The end: the last sample grid, the tracker closed, the last checkpoint and every save finished."""
    if run.cfg.train.sample_every:
        write_samples(run, step)
    if run.tracker is not None:  # (every event is flushed when logged: a run that dies loses none)
        run.tracker.close()
    path = _save(run, step)
    _finish_saves(run)
    if run.d.is_main:
        log.info("finished %d steps; checkpoint %s, samples in %s", step, path, run.run_dir / "samples")
    return run.run_dir


class _DeferredInterrupt:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption notice) into a flag checked
    between steps, so a step is never cut in half (e.g. between the optimizer update and the EMA update) and
    the run saves a checkpoint; a second signal interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.pending: str | None = None  # the first signal's name
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = signal.Signals(signum).name
        log.warning("%s: finishing this step and saving a checkpoint (again to stop at once)", self.pending)

    def check(self, writing: bool, group: dist.ProcessGroup | None = None) -> bool:
        """Between two steps: raise KeyboardInterrupt on every rank if any rank was interrupted (torchrun may
        signal only some ranks, e.g. only one host's); else return whether a background save is still being
        written on any rank (``writing``: this rank's ``Checkpointer.writing()``). One tiny all-reduce on ``group``
        (gloo, host tensors: no device sync) per step makes the ranks agree on both."""
        flags = torch.tensor([int(self.pending is not None), int(writing)])
        if group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        interrupt, writing = flags.tolist()
        if interrupt:
            raise KeyboardInterrupt
        return bool(writing)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
