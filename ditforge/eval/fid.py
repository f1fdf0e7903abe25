"""FID, sFID, Inception Score and precision / recall, defined as guided-diffusion's ADM evaluator defines them
(openai/guided-diffusion, ``evaluations/evaluator.py``; the numbers the DiT paper reports), on the features of
Inception-v3 (torch-fidelity's port of the TF 2015-12-05 graph, weights from a local file) or of any other
extractor (``ditforge.eval.digits``).

An extractor is an object with ``name`` (str), ``provides`` (the feature kinds it gives, of ``pool``: the
features of FID and precision / recall; ``spatial``: those of sFID; ``logits``: those of IS) and a call
``(images (B, C, H, W) uint8 on its device, C 1 or 3) -> {kind: (B, D) float tensor}``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ditforge.atomic import atomic_path
from ditforge.errors import UserError

METRIC_FEATURES = {"fid": "pool", "sfid": "spatial", "is": "logits", "pr": "pool"}
INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of features, as ADM's ``Evaluator.compute_statistics``.

    Args:
        features: (N, D) float, N >= 2.

    Returns:
        ``mu`` (D,) float64 and ``sigma`` (D, D) float64, the unbiased (N - 1) covariance (``np.cov``).
    """
    features = np.asarray(features, dtype=np.float64)
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     eps: float = 1e-6) -> float:
    """Fréchet distance between the Gaussians N(mu1, sigma1) and N(mu2, sigma2) (Heusel et al. 2017, eq. 6):
    ``|mu1 - mu2|^2 + Tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))``, in float64, computed as ADM's
    ``FIDStatistics.frechet_distance``: ``scipy.linalg.sqrtm`` of the product; where that is not finite, eps is
    added to both diagonals; an imaginary part of the root's diagonal up to 1e-3 is numerical noise and dropped.

    Args:
        mu1, mu2: (D,) means; sigma1, sigma2: (D, D) covariances (feature units, squared).

    Returns:
        The distance, in squared feature units.

    Raises:
        UserError: the root keeps a larger imaginary part (ADM raises ValueError there): with fewer samples than
            feature dimensions the covariances are singular; evaluate more samples.
    """
    from scipy import linalg

    diff = mu1 - mu2
    covmean = linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise UserError(f"Fréchet distance: the matrix square root keeps an imaginary part of "
                            f"{np.abs(covmean.imag).max():.3g}; evaluate more samples than the {len(mu1)} feature "
                            "dimensions")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def inception_score(logits: np.ndarray, split_size: int = 5000) -> float:
    """Inception Score (Salimans et al. 2016, eq. in sec. 4: ``exp(E_x KL(p(y|x) || p(y)))``), as ADM's
    ``Evaluator.compute_inception_score``: the samples in order, in splits of ``split_size`` (the last one may be
    shorter), the score of each split with p(y) its mean prediction, then the mean over splits.

    Args:
        logits: (N, K) float; softmax gives p(y|x). Inception: the 1008 logits without the bias, as ADM (it
            multiplies the pool features by ``softmax/logits/MatMul``'s weight) and torch-fidelity
            (``logits_unbiased``) take them.

    Returns:
        The score, in [1, K]. Computed in float64; log p(y|x) comes from ``log_softmax`` (ADM takes the log of the
        float32 softmax, which is -inf where that underflows).
    """
    logits = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    scores = []
    for part in logits.split(split_size):
        p, log_p = part.softmax(dim=1), part.log_softmax(dim=1)
        kl = (p * (log_p - p.mean(dim=0, keepdim=True).log())).sum(dim=1).mean()
        scores.append(kl.exp().item())
    return float(np.mean(scores))


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # ADM's _batch_pairwise_distances: |a|^2 - 2 a.b + |b|^2, clamped at 0 (ADM: float16, float32 on overflow).
    return (a.square().sum(1, keepdim=True) - 2 * a @ b.T + b.square().sum(1)).clamp_min(0)


def _radii(features: torch.Tensor, k: int, batch_size: int) -> torch.Tensor:
    # The squared distance of each point to its k-th nearest neighbour; the point itself is the 0-th.
    return torch.cat([_squared_distances(rows, features).kthvalue(k + 1, dim=1).values
                      for rows in features.split(batch_size)])


def _inside(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor, batch_size: int) -> float:
    # The fraction of points within the ball of some centre.
    inside = [(_squared_distances(rows, centres) <= radii).any(dim=1) for rows in points.split(batch_size)]
    return torch.cat(inside).double().mean().item()


def precision_recall(ref: np.ndarray, samples: np.ndarray, k: int = 3, batch_size: int = 4096,
                     device: torch.device | str = "cpu") -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019, eqs. 1-3), as ADM's ``compute_prec_recall``:
    each set's manifold is the union of balls around its points, of radius the distance to the k-th nearest other
    point; precision is the fraction of samples inside the reference manifold, recall the fraction of reference
    points inside the sample manifold (a point on a ball's surface counts as inside).

    Args:
        ref: (N_ref, D) and samples: (N, D) float features; both need more than k points.
        k: the neighbourhood size (ADM and the paper: 3).
        batch_size: rows of each distance block (memory: batch_size x max(N, N_ref) float64).
        device: where the distances are computed.

    Returns:
        ``(precision, recall)``, fractions in [0, 1]. Distances are squared Euclidean in float64 (ADM: float16 with a
        float32 fallback), so a point within float16 rounding of a radius may be counted differently.
    """
    ref_t = torch.as_tensor(np.asarray(ref), dtype=torch.float64, device=device)
    samples_t = torch.as_tensor(np.asarray(samples), dtype=torch.float64, device=device)
    ref_radii, sample_radii = _radii(ref_t, k, batch_size), _radii(samples_t, k, batch_size)
    return (_inside(samples_t, ref_t, ref_radii, batch_size), _inside(ref_t, samples_t, sample_radii, batch_size))


class InceptionV3:
    """torch-fidelity's ``FeatureExtractorInceptionV3`` (its PyTorch port of the TF Inception-v3 graph of
    2015-12-05 that ADM, TTUR and clean-fid's ``legacy_tensorflow`` mode use), from a local weights file.

    Input: (B, C, H, W) uint8, C 1 (repeated to RGB) or 3. torch-fidelity resizes to 299x299 with TF1's
    bilinear resize (``align_corners=False``, bit-exact on the CPU), then scales to [-1, 1] by (x - 128) / 128:
    the operations of the TF graph ADM feeds its uint8 images into (``ResizeBilinear`` after ``ExpandDims``), so
    the resizing is ADM's (not clean-fid's default ``clean`` mode, which resizes with PIL bicubic first).

    Output: ``pool`` (B, 2048) float32, pool_3 (FID, precision / recall); ``logits`` (B, 1008), the logits
    without the bias (IS); ``spatial`` (B, 2023): the first 7 of the 192 channels of ADM's ``mixed_6/conv``
    (torch-fidelity's ``Mixed_6d.branch1x1``: conv, batch norm, ReLU; 17x17), flattened in ADM's NHWC order.
    torch-fidelity returns no such spatial map, so a forward hook on that module taps it.

    Raises:
        UserError: the file is missing (naming the file to obtain), not a plain PyTorch state dict (read with
            ``weights_only=True``: no code runs), not of Inception-v3's layout and shapes, or torch-fidelity is not
            installed.
    """

    name = "inception"
    provides = ("pool", "spatial", "logits")

    def __init__(self, weights: str | Path, device: torch.device | str = "cpu"):
        path = Path(weights)
        if not path.is_file():
            raise UserError(f"--inception {path}: no such file; obtain torch-fidelity's {INCEPTION_FILE} (its "
                            "release v0.2.0) and pass its path (nothing is downloaded)")
        try:
            torch.load(path, map_location="cpu", weights_only=True)  # refuses pickles that would run code
        except Exception as e:
            raise UserError(f"--inception {path}: not a PyTorch state dict ({str(e).splitlines()[0]})") from None
        try:
            from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
        except ImportError as e:
            raise UserError(f"--inception needs torch-fidelity: pip install 'ditforge[eval]' ({e})") from None
        try:  # torch-fidelity reads the file again (the check above made sure it holds only tensors)
            self.net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                                   feature_extractor_weights_path=str(path)).to(device)
        except RuntimeError as e:  # load_state_dict: missing keys or shapes of another network
            raise UserError(f"--inception {path}: not Inception-v3 weights of torch-fidelity's layout "
                            f"({str(e).splitlines()[0]} ...)") from None
        self.net.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)
        self.device = torch.device(device)

    def _keep_spatial(self, module, inputs, output: torch.Tensor) -> None:
        self._spatial = output[:, :7].permute(0, 2, 3, 1).flatten(1)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        images = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
        pool, logits = self.net(images)
        return {"pool": pool, "logits": logits, "spatial": self._spatial.float()}


def extract_features(extractor, images: np.ndarray, kinds: set[str], batch_size: int) -> dict[str, np.ndarray]:
    """Run ``extractor`` over images (or videos) in batches, channels moved to axis 1 for it.

    Args:
        images: (N, H, W, C) uint8, C 1 or 3 (ADM's sample layout), or videos (N, T, H, W, C) uint8 for a video
            extractor (``fvd.I3D``, which reads (B, C, T, H, W)).
        kinds: the feature kinds to keep (see the module docstring).

    Returns:
        ``{kind: (N, D) float32}``.
    """
    out: dict[str, list[np.ndarray]] = {kind: [] for kind in kinds}
    for start in range(0, len(images), batch_size):
        batch = torch.from_numpy(np.ascontiguousarray(images[start : start + batch_size]))
        feats = extractor(batch.to(extractor.device).movedim(-1, 1))
        for kind in kinds:
            out[kind].append(feats[kind].float().cpu().numpy())
    return {kind: np.concatenate(parts) for kind, parts in out.items()}


def reference_statistics(extractor, images: np.ndarray, batch_size: int) -> dict[str, np.ndarray]:
    """The statistics of a reference set, as ``save_reference`` caches them.

    Args:
        images: (N, H, W, C) uint8, or videos (N, T, H, W, C) for a video extractor.

    Returns:
        ``mu``, ``sigma`` (FID, FVD) and, with Inception, ``mu_s``, ``sigma_s`` (sFID): the keys of ADM's reference
        batches; ``pool`` (N, D) float32, the features precision / recall need; ``image_size`` (2,) int64 (H, W);
        ``extractor`` (the extractor's name, a 0-d str array); for videos ``num_frames`` (0-d int64, T).
    """
    feats = extract_features(extractor, images, {"pool", "spatial"} & set(extractor.provides), batch_size)
    stats = dict(zip(("mu", "sigma"), feature_statistics(feats["pool"])), pool=feats["pool"])
    if "spatial" in feats:
        stats.update(zip(("mu_s", "sigma_s"), feature_statistics(feats["spatial"])))
    if images.ndim == 5:
        stats["num_frames"] = np.array(images.shape[1])
    return {**stats, "image_size": np.array(images.shape[-3:-1]), "extractor": np.array(extractor.name)}


def save_reference(stats: dict[str, np.ndarray], path: str | Path) -> Path:
    """Write reference statistics (``reference_statistics``) to an .npz, atomically. Returns the path."""
    with atomic_path(path, suffix=".npz") as tmp:  # np.savez appends .npz to other names
        np.savez(tmp, **stats)
    return Path(path)


def compute_metrics(feats: dict[str, np.ndarray], ref: dict[str, np.ndarray], metrics: list[str],
                    device: torch.device | str = "cpu") -> dict[str, float]:
    """The metrics of sample features against reference statistics.

    Args:
        feats: ``{kind: (N, D)}`` features of the samples (``extract_features``).
        ref: reference statistics (``reference_statistics``; ``pool`` only where ``pr`` is asked).
        metrics: of ``fid`` (on ``pool``), ``sfid`` (on ``spatial``), ``is`` (on ``logits``; needs no reference),
            ``pr`` (on ``pool``).

    Returns:
        ``fid``, ``sfid``, ``is``, ``precision``, ``recall`` as asked.
    """
    out: dict[str, float] = {}
    if "fid" in metrics:
        out["fid"] = frechet_distance(*feature_statistics(feats["pool"]), ref["mu"], ref["sigma"])
    if "sfid" in metrics:
        out["sfid"] = frechet_distance(*feature_statistics(feats["spatial"]), ref["mu_s"], ref["sigma_s"])
    if "is" in metrics:
        out["is"] = inception_score(feats["logits"])
    if "pr" in metrics:
        out["precision"], out["recall"] = precision_recall(ref["pool"], feats["pool"], device=device)
    return out
