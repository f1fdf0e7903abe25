"""The checks of a run's settings, run once at start (``validate``): ranges, choices and the flags that do not go
together, each refused in one line naming the flag and what was expected."""

from __future__ import annotations

from pathlib import Path

from ditforge.config.sections import (CAPTION_MISSING, COMPILE_MODES, CONDITIONS, CPU_OFFLOAD, FP8_RECIPES,
                                      LIBRARY_OPTIMIZERS, MASTER_WEIGHTS, MIXED_PRECISION, OBJECTIVES, OPTIMIZERS,
                                      PLUGINS, RESIZE_MODES, SEQUENCE_PARALLEL_TYPES, RunConfig)
from ditforge.config.values import parse_bytes, parse_checkpoint_policy, report_backends
from ditforge.errors import UserError


def _check_packing(cfg: RunConfig) -> None:
    """``--pack_tokens`` with what it does not support: one line naming the other flag."""
    if cfg.parallel.sequence_parallel_size > 1:
        raise UserError("--pack_tokens: not with --sequence_parallel_size > 1 (the sequence-parallel attentions "
                        "split one sequence per sample, not packed samples); use data parallelism")
    if (cfg.model.model or "").startswith("STDiT"):
        raise UserError(f"--pack_tokens: not with --model {cfg.model.model} (its attention across frames does not "
                        "pack); use a DiT or vDiT")
    if cfg.train.enable_modulate_kernel:
        raise UserError("--pack_tokens: not with --enable_modulate_kernel (its kernels take one modulation row per "
                        "sample, packed tokens carry one each); --enable_layernorm_kernel works")


def _check_tensor_parallel(cfg: RunConfig) -> None:
    """``--tensor_parallel`` with what it does not support: one line naming the other flag."""
    t, m, tp = cfg.train, cfg.model, cfg.parallel.tensor_parallel
    others = [("--init_from", m.init_from is not None and not (m.model or "").startswith(("DiT", "vDiT", "STDiT"))),
              ("--lora_rank", bool(m.lora_rank)), ("--mixed_precision fp8", t.mixed_precision == "fp8"),
              ("--pack_tokens", bool(t.pack_tokens)), ("--fused_backward_pass", t.fused_backward_pass),
              (f"--cpu_offload {t.cpu_offload}", t.cpu_offload != "none"),
              (f"--optimizer {t.optimizer}", t.optimizer != "adamw"),
              (f"--master_weights {t.master_weights}", t.master_weights != "fp32"),
              (f"--plugin {cfg.parallel.plugin}", cfg.parallel.plugin == "ddp")]
    sp_type = cfg.parallel.sequence_parallel_type
    if cfg.parallel.sequence_parallel_size > 1 and sp_type not in ("auto", "ring", "ulysses"):
        raise UserError(f"--tensor_parallel {tp} with --sequence_parallel_size: ulysses (over the heads each "
                        f"process holds) or ring attention (auto picks one); not --sequence_parallel_type {sp_type}")
    clash = next((flag for flag, on in others if on), None)
    if clash:
        raise UserError(f"--tensor_parallel {tp}: splits ditforge's own DiTs, trained by AdamW over fp32 weights, "
                        f"with zero2 / fsdp over the data-parallel processes; not with {clash}")


def _check_optimizer(cfg: RunConfig) -> None:
    """``--optimizer``, ``--master_weights``, ``--cpu_offload`` and ``--delayed_update`` against each other and the
    precision: one line naming the flags."""
    t = cfg.train
    if t.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {t.optimizer}")
    if t.master_weights not in MASTER_WEIGHTS:
        raise UserError(f"--master_weights: expected one of {', '.join(MASTER_WEIGHTS)}, got {t.master_weights}")
    if t.optimizer in LIBRARY_OPTIMIZERS:
        # torchao's bf16 stochastic rounding draws from the global generator (a resume would not be exact) and
        # keeps the moments of its unquantized small tensors in bf16, where the second moment stalls
        if t.master_weights != "fp32":
            raise UserError(f"--optimizer {t.optimizer}: takes --master_weights fp32, got {t.master_weights} (bf16 "
                            "weights: --optimizer adamw8bit)")
        if t.fused_backward_pass or t.cpu_offload != "none":
            raise UserError(f"--optimizer {t.optimizer}: the library's optimizer steps after the backward, on the "
                            "GPU; not with --fused_backward_pass or --cpu_offload (use adamw or adamw8bit)")
        if cfg.parallel.async_checkpoint and t.optimizer != "adafactor":
            # torch's staging copy of a state dict calls zeros_like, which torchao's state tensors do not implement
            raise UserError(f"--optimizer {t.optimizer}: its torchao states are saved synchronously; not with "
                            "--async_checkpoint")
    if t.master_weights != "fp32" and t.mixed_precision not in ("bf16", "auto"):
        raise UserError(f"--master_weights {t.master_weights}: needs --mixed_precision bf16, got {t.mixed_precision}")
    if t.fused_backward_pass and t.mixed_precision == "fp16":
        raise UserError("--fused_backward_pass: not with --mixed_precision fp16 (the loss scaler must see every "
                        "gradient before any step); use bf16")
    if t.gpu_memory_budget is not None:
        parse_bytes(t.gpu_memory_budget, "--gpu_memory_budget")
    if t.cpu_offload not in CPU_OFFLOAD:
        raise UserError(f"--cpu_offload: expected one of {', '.join(CPU_OFFLOAD)}, got {t.cpu_offload}")
    if t.cpu_offload == "optimizer" and t.fused_optimizer == "off":
        raise UserError("--cpu_offload optimizer: needs the one-pass optimizer step, not --fused_optimizer off")
    if t.cpu_offload == "all" and (t.optimizer, t.master_weights, t.fused_backward_pass) != ("adamw", "fp32", False):
        raise UserError("--cpu_offload all: steps torch's AdamW over fp32 weights on the CPU; not with --optimizer "
                        f"{t.optimizer}, --master_weights {t.master_weights} or --fused_backward_pass")
    if t.cpu_offload == "all" and t.mixed_precision == "fp16":  # the scaler's found-inf would stay on the GPU
        raise UserError("--cpu_offload all: not with --mixed_precision fp16 (the CPU step takes no loss scaler); "
                        "use bf16")
    if t.delayed_update and t.cpu_offload != "all":
        raise UserError(f"--delayed_update: needs --cpu_offload all, got --cpu_offload {t.cpu_offload}")


def validate(cfg: RunConfig) -> None:
    """Check ranges and choices once at start. Raises UserError naming the flag and what was expected."""
    t = cfg.train
    positive = {"grad_accum_steps": cfg.parallel.grad_accum_steps, "max_nonfinite_steps": t.max_nonfinite_steps,
                "eval_samples": t.eval_samples, "loss_spike_window": t.loss_spike_window,
                "sequence_parallel_size": cfg.parallel.sequence_parallel_size,
                "tensor_parallel": cfg.parallel.tensor_parallel, "batch_size": t.batch_size, "ckpt_every": t.ckpt_every, "log_every": t.log_every,
                "keep_last": t.keep_last, "max_steps": t.max_steps, "epochs": t.epochs,
                "image_size": cfg.data.image_size, "num_classes": cfg.model.num_classes,
                "num_frames": cfg.data.num_frames, "frame_interval": cfg.data.frame_interval,
                "text_max_length": cfg.model.text_max_length, "depth": cfg.model.depth,
                "fp8_min_width": t.fp8_min_width}
    for name, value in positive.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise UserError(f"--{name}: expected a positive integer, got {value!r}")
    nonnegative = {"warmup_steps": t.warmup_steps, "sample_every": t.sample_every, "pack_tokens": t.pack_tokens,
                   "blocks_to_swap": t.blocks_to_swap,
                   "num_workers": cfg.data.num_workers, "max_loss_spike_rollbacks": t.max_loss_spike_rollbacks}
    for name, value in nonnegative.items():
        if value is not None and (not isinstance(value, int) or value < 0):
            raise UserError(f"--{name}: expected an integer >= 0, got {value!r}")
    if t.validation_prompts is not None and not t.sample_every:
        raise UserError(f"--validation_prompts {t.validation_prompts}: rendered every --sample_every steps and at the "
                        "end; give --sample_every N (N >= 1), not 0")
    if t.max_steps is not None and t.epochs is not None:
        raise UserError("--max_steps and --epochs: give one, not both")
    for name, value, low in (("lr", t.lr, 0), ("loss_spike_factor", t.loss_spike_factor, 1)):
        if value is not None and not value > low:
            raise UserError(f"--{name}: expected a number > {low}, got {value}")
    if not 0 <= t.ema_decay < 1:
        raise UserError(f"--ema_decay: expected a number in [0, 1), got {t.ema_decay}")
    if not 0 <= cfg.model.class_dropout_prob < 1:
        raise UserError(f"--class_dropout_prob: expected a number in [0, 1), got {cfg.model.class_dropout_prob}")
    if cfg.parallel.plugin not in PLUGINS:
        raise UserError(f"--plugin: expected one of {', '.join(PLUGINS)}, got {cfg.parallel.plugin}")
    if not cfg.parallel.collective_timeout > 0:
        raise UserError(f"--collective_timeout: expected seconds > 0, got {cfg.parallel.collective_timeout}")
    if t.mixed_precision not in MIXED_PRECISION:
        raise UserError(f"--mixed_precision: expected one of {', '.join(MIXED_PRECISION)}, got {t.mixed_precision}")
    if t.fp8_recipe not in FP8_RECIPES:
        raise UserError(f"--fp8_recipe: expected one of {', '.join(FP8_RECIPES)}, got {t.fp8_recipe}")
    if t.fp8_recipe != "tensorwise" and t.mixed_precision != "fp8":
        raise UserError(f"--fp8_recipe {t.fp8_recipe}: needs --mixed_precision fp8, got {t.mixed_precision}")
    if t.fp8_recipe == "rowwise_with_gw_hp" and t.compile == "none":
        # eager, torchao's bf16 weight-gradient product meets the fp32 master weight: "expected m1 and m2 to have
        # the same dtype" (torchao 0.18); compiled, the same recipe runs
        raise UserError("--fp8_recipe rowwise_with_gw_hp: needs --compile (eager it fails in torchao)")
    _check_optimizer(cfg)
    if cfg.parallel.sequence_parallel_type not in SEQUENCE_PARALLEL_TYPES:
        raise UserError(f"--sequence_parallel_type: expected one of {', '.join(SEQUENCE_PARALLEL_TYPES)}, got "
                        f"{cfg.parallel.sequence_parallel_type}")
    if cfg.parallel.tensor_parallel > 1:
        _check_tensor_parallel(cfg)
    if cfg.model.condition not in CONDITIONS:
        raise UserError(f"--condition: expected one of {', '.join(CONDITIONS)}, got {cfg.model.condition}")
    if t.compile not in COMPILE_MODES:
        raise UserError(f"--compile: expected one of {', '.join(COMPILE_MODES)}, got {t.compile}")
    if t.device not in ("auto", "cpu", "cuda") and not t.device.startswith("cuda:"):
        raise UserError(f"--device: expected cuda, cpu or auto, got {t.device}")
    report_backends(t.report_to)
    if t.eval_every and (cfg.data.data != "digits" or cfg.data.instance_data or cfg.model.init_from):
        raise UserError(f"--eval_every: the built-in extractor measures DiT runs on --data digits, not "
                        f"{cfg.data.instance_data or cfg.data.data}; for other data draw samples with `ditforge sample "
                        "--save_npz` and measure them with `ditforge eval --inception`")
    from ditforge.models import model_spec  # raises UserError for unknown names

    parse_checkpoint_policy(t.grad_checkpoint)
    if cfg.model.model is not None:
        model_spec(cfg.model.model)
    if t.pack_tokens:
        _check_packing(cfg)
    m, data = cfg.model, cfg.data
    if m.objective not in OBJECTIVES:
        raise UserError(f"--objective: expected one of {', '.join(OBJECTIVES)}, got {m.objective}")
    if m.lora_rank < 0:
        raise UserError(f"--lora_rank: expected an integer >= 0, got {m.lora_rank}")
    if m.train_text_encoder and m.init_from is None:
        raise UserError("--train_text_encoder: trains a pretrained pipeline's text encoder; give --init_from")
    if m.lora_rank and m.init_from is None:
        raise UserError("--lora_rank: LoRA adapts pretrained weights; give --init_from")
    if t.blocks_to_swap and not (m.lora_rank and t.grad_checkpoint != "none" and t.compile == "none"
                                 and cfg.parallel.plugin in ("auto", "none", "ddp")):
        raise UserError("--blocks_to_swap: swaps a LoRA run's frozen base; needs --lora_rank, --grad_checkpoint, no "
                        "--compile and --plugin none or ddp")
    from ditforge.models.adapters.single_file import component_files  # torch: imported at the check, not for --help

    for name, file in component_files(m).items():
        if name in ("transformer", "transformer_2") or Path(file).is_file():  # a missing --vae: load_vae's to name
            if m.init_from is None or not (Path(m.init_from) / "model_index.json").is_file():
                raise UserError(f"--{name} {file}: a single file replaces a component of a diffusers pipeline "
                                "folder; give that folder as --init_from")
            if not Path(file).is_file():
                raise UserError(f"--{name} {file}: no such file")
    if m.fp8_base and not m.lora_rank:
        raise UserError("--fp8_base: stores the frozen base of a LoRA run; give --lora_rank")
    if data.resize_mode not in RESIZE_MODES:
        raise UserError(f"--resize_mode: expected one of {', '.join(RESIZE_MODES)}, got {data.resize_mode}")
    if (data.instance_data is None) != (data.instance_prompt is None):
        raise UserError("--instance_data and --instance_prompt: DreamBooth needs both")
    if (data.class_data is None) != (data.class_prompt is None):
        raise UserError("--class_data and --class_prompt: prior preservation needs both")
    if data.class_data is not None and data.instance_data is None:
        raise UserError("--class_data: prior preservation is part of DreamBooth; give --instance_data too")
    if data.caption_missing not in CAPTION_MISSING:
        raise UserError(f"--caption_missing: expected one of {', '.join(CAPTION_MISSING)}, got {data.caption_missing}")
    if data.buckets is not None and data.instance_data is not None:
        raise UserError("--buckets: not with --instance_data (DreamBooth trains at one --image_size)")
    if data.num_class_images < 1:
        raise UserError(f"--num_class_images: expected a positive integer, got {data.num_class_images}")
    if data.class_sampling_steps < 1:
        raise UserError(f"--class_sampling_steps: expected a positive integer, got {data.class_sampling_steps}")
