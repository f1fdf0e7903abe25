"""``ditforge eval``: read a sample set and a reference set (.npz files, image folders, the built-in ``digits``;
``readers``), extract features (Inception-v3 from ``--inception``, else the built-in digits CNN) and compute the
metrics."""

from __future__ import annotations

import logging

import numpy as np

from ditforge.errors import UserError
from ditforge.eval.fid import METRIC_FEATURES, InceptionV3, compute_metrics, extract_features, save_reference
from ditforge.eval.fvd import evaluate_fvd
from ditforge.eval.readers import load_reference, read_images, read_prompts

METRICS = ("fid", "sfid", "is", "pr", "accuracy", "clip", "identity", "fvd")
log = logging.getLogger(__name__)


def _choose_metrics(metrics: list[str] | None, extractor, labels: np.ndarray | None, samples: str) -> list[str]:
    if metrics is None:  # all the extractor gives; accuracy only where the samples carry labels
        metrics = ["fid", "sfid", "is", "pr"] if extractor.name == "inception" else ["fid", "pr", "accuracy"]
        return [m for m in metrics if m != "accuracy" or labels is not None]
    for m in metrics:
        if m not in METRICS:
            raise UserError(f"--metrics {m}: unknown (choose from {', '.join(METRICS)})")
        if m == "accuracy" and extractor.name != "digits":
            raise UserError("--metrics accuracy: only with the built-in digits extractor (no --inception)")
        if m == "accuracy" and labels is None:
            raise UserError(f"--metrics accuracy: {samples} holds no labels ('labels' or 'arr_1')")
        if m != "accuracy" and METRIC_FEATURES[m] not in extractor.provides:
            raise UserError(f"--metrics {m}: needs --inception (the {extractor.name} extractor has no "
                            f"{METRIC_FEATURES[m]} features)")
    return metrics


def evaluate(samples: str, ref: str | None = None, inception: str | None = None, metrics: list[str] | None = None,
             batch_size: int | None = None, device: str = "auto", save_ref: str | None = None,
             clip: str | None = None, i3d: str | None = None, num_frames: int = 16,
             frame_interval: int = 1, reference_image: list[str] | None = None,
             image_encoder: str | None = None) -> dict[str, float | int | str | list[float]]:
    """``ditforge eval``: the metrics of a sample set against a reference set.

    Args:
        samples: see ``readers.read_images``.
        ref: see ``readers.load_reference``.
        inception: a local torch-fidelity Inception-v3 weights file (``fid.InceptionV3``); without it the built-in
            digits CNN (``ditforge.eval.digits``), which reads 8x8 images.
        metrics: of ``fid``, ``sfid`` (Inception), ``is``, ``pr`` (precision and recall), ``accuracy`` (digits,
            with labels), ``clip`` (the CLIP score against the samples' prompts, ``clip_score``; needs ``clip``
            and no ``ref``), ``fvd`` (videos, alone; ``fvd.evaluate_fvd``); default: fvd with ``i3d``, fid, sfid,
            is, pr with Inception, fid, pr and accuracy (where the samples carry labels) with digits.
        clip: a local CLIP folder (``clip_score.clip_score``).
        reference_image, image_encoder: ``identity`` (``identity.identity_scores``, alone or with ``clip``): the
            reference image files and the local CLIP or DINOv2 folder; video samples give their first
            ``num_frames`` frames.
        i3d: FVD's I3D, a local ``i3d_torchscript.pt`` (``fvd.I3D``); num_frames, frame_interval: see
            ``fvd.evaluate_fvd``.
        batch_size: images per extractor batch (default 100; FVD: videos, default 8).
        device: ``auto``, ``cpu``, ``cuda``...
        save_ref: also write the reference statistics to this .npz, for a later ``--ref``.

    Returns:
        ``num_samples``, ``identity_score`` (the mean) and ``identity_scores`` (per sample) if asked, ``clip_score``
        if asked, then ``extractor``, ``fid``, ``sfid``, ``is``, ``precision``,
        ``recall``, ``accuracy`` as asked (see ``fid.compute_metrics``); for FVD, ``fvd.evaluate_fvd``'s.

    Raises:
        UserError: see ``readers.read_images``, ``readers.load_reference`` and ``fid.InceptionV3``; a metric that
            is unknown or that the extractor or the samples cannot give; images other than 8x8 without
            ``--inception``; ``clip`` without a CLIP folder or prompts (``readers.read_prompts``); a metric of the
            reference without ``ref``; fvd with another metric or without ``i3d``, ``i3d`` without fvd; see
            ``fvd.evaluate_fvd``; identity without ``reference_image`` or ``image_encoder`` (see
            ``identity.load_encoder``, ``identity.read_references``).
    """
    from ditforge.config.values import resolve_device

    device = resolve_device(device)
    if (metrics is None and i3d) or (metrics and "fvd" in metrics):
        if metrics not in (None, ["fvd"]) or i3d is None:
            raise UserError("--metrics fvd: measured alone, with --i3d (the other metrics read images)")
        return evaluate_fvd(samples, ref, i3d, num_frames, frame_interval, batch_size, device, save_ref)
    if i3d is not None:
        raise UserError(f"--i3d: only for --metrics fvd, not {','.join(metrics)}")
    batch_size = batch_size or 100
    out: dict[str, float | int | str | list[float]] = {}
    if metrics is not None and "identity" in metrics:
        from ditforge.eval import identity

        if not reference_image or image_encoder is None:
            raise UserError("--metrics identity: needs --reference_image (one or more) and --image_encoder")
        if set(metrics) - {"identity", "clip"}:
            raise UserError("--metrics identity: measured alone or with clip (no reference set)")
        refs = identity.read_references(reference_image)
        videos = identity.read_identity_samples(samples, num_frames)
        scores = identity.identity_scores(videos, refs, image_encoder, device, batch_size)
        out.update(num_samples=len(videos), identity_score=float(np.mean(scores)), identity_scores=scores)
        metrics = [m for m in metrics if m != "identity"]
        if not metrics:
            return out
    images, labels = read_images(samples, "--samples")
    out["num_samples"] = len(images)
    if metrics is not None and "clip" in metrics:
        if clip is None:
            raise UserError("--metrics clip: needs --clip, a local CLIP folder")
        from ditforge.eval.clip_score import clip_score

        out["clip_score"] = clip_score(images, read_prompts(samples), clip, device, batch_size)
        metrics = [m for m in metrics if m != "clip"]
        if not metrics:
            return out
    if ref is None:
        raise UserError("--ref: needed for fid, sfid, is, pr and accuracy (only --metrics clip goes without)")
    if inception is None:
        from ditforge.eval.digits import DigitsExtractor

        if images.shape[1:3] != (8, 8):
            raise UserError(f"--inception: the samples are {images.shape[2]}x{images.shape[1]}; the built-in digits "
                            "extractor reads 8x8 digits, other images need Inception-v3 weights")
        extractor = DigitsExtractor(device)
    else:
        extractor = InceptionV3(inception, device)
    metrics = _choose_metrics(metrics, extractor, labels, samples)
    if labels is not None and len(labels) != len(images):
        raise UserError(f"--samples {samples}: {len(labels)} labels for {len(images)} images")
    reference = load_reference(ref, extractor, images.shape[1:3], batch_size)
    if "pr" in metrics and "pool" not in reference:
        raise UserError(f"--ref {ref}: statistics without the features precision / recall need (no 'pool', no images)")
    if save_ref:
        log.info("wrote %s", save_reference(reference, save_ref))
    kinds = {METRIC_FEATURES[m] for m in metrics if m != "accuracy"} | ({"logits"} if "accuracy" in metrics else set())
    feats = extract_features(extractor, images, kinds, batch_size)
    out["extractor"] = extractor.name
    out.update(compute_metrics(feats, reference, metrics, device))
    if "accuracy" in metrics:
        from ditforge.eval.digits import class_accuracy

        out["accuracy"] = class_accuracy(feats["logits"], labels)
    return out
