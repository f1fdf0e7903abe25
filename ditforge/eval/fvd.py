"""FVD, the Fréchet Video Distance (Unterthiner et al. 2018, "Towards Accurate Generative Models of Video"): the
Fréchet distance (``fid.frechet_distance``) between the Gaussians fitted to the I3D features of two video sets.

The detector is the Kinetics-400 I3D of the paper (the tf.hub module google-research's
``frechet_video_distance.py`` loads) in the TorchScript form StyleGAN-V published and checked against that TF code
(``i3d_torchscript.pt``; StyleGAN-V ``src/metrics/frechet_video_distance.py``, which the cd-fvd package and
others reuse). It is loaded with ``torch.jit.load`` from a local file: no library is needed and nothing is
downloaded. The pip package cd-fvd was the library candidate, but its I3D is another network (the PyTorch port of
the original I3D release, ``i3d_pretrained_400.pt``; StyleGAN-V notes that the tf.hub weights FVD uses differ from
those), it requires torchvision (whose wheels would replace a CPU torch) and it fetches weights it does not find.

Input convention, as StyleGAN-V calls the detector: videos (B, 3, T, H, W) uint8 in [0, 255] (grey repeated to
RGB), ``rescale=True`` (the module maps [0, 255] to [-1, 1]), ``resize=True`` (it resizes every frame to 224x224,
bilinearly; StyleGAN-V: this matches the TF code "up to the upsampling operation"), ``return_features=True``:
(B, 400) float, the logits before the softmax. Frames: the first ``num_frames`` of each video (16: the paper's
and StyleGAN-V's ``fvd2048_16f``). Videos: all given (the paper and StyleGAN-V use 2,048 of each set; report N).
The covariances are unbiased (N - 1, ``fid.feature_statistics``) as in TF-GAN's ``frechet_classifier_distance``
that the paper's code calls; StyleGAN-V divides by N, a relative difference of 1 / N.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ditforge.errors import UserError
from ditforge.eval.fid import extract_features, feature_statistics, frechet_distance, save_reference
from ditforge.eval.readers import load_reference, read_folder, read_npz, sample_array

I3D_FILE = "i3d_torchscript.pt"
I3D_SOURCE = "https://www.dropbox.com/s/ge9e5ujwgetktms/i3d_torchscript.pt, linked from StyleGAN-V's README"
I3D_FEATURES = 400  # Kinetics-400 classes: return_features gives the logits before the softmax
FVD_FRAMES = 16
FVD_BATCH_SIZE = 8  # videos per I3D batch: StyleGAN-V's 128 frames at 256px / 16 frames
log = logging.getLogger(__name__)


class I3D:
    """The FVD detector from a local TorchScript file (see the module docstring), with the extractor interface
    of ``fid.py``: ``name`` ``i3d``; ``provides`` ``pool``: its (B, 400) float32 features.

    Input: (B, C, T, H, W) uint8, C 1 (repeated to RGB) or 3, any H, W (resized to 224x224 inside).

    Raises:
        UserError: the file is missing (naming the file to obtain and where it is published), not TorchScript,
            not callable as ``detector(videos, rescale=, resize=, return_features=)``, or its features are not
            (B, 400).
    """

    name = "i3d"
    provides = ("pool",)

    def __init__(self, path: str | Path, device: torch.device | str = "cpu"):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"--i3d {path}: no such file; obtain {I3D_FILE}, the Kinetics-400 I3D of FVD as "
                            f"TorchScript ({I3D_SOURCE}), and pass its path (nothing is downloaded)")
        try:
            self.net = torch.jit.load(str(self.path), map_location=device).eval()
        except (RuntimeError, ValueError) as e:  # not a zip archive, or a zip without TorchScript code
            reason = str(e).strip().splitlines()[0].split(". ")[0]  # torch appends paragraphs of advice
            raise UserError(f"--i3d {path}: not a TorchScript file ({reason}); expected {I3D_FILE}") from None
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, videos: torch.Tensor) -> dict[str, torch.Tensor]:
        videos = videos.expand(-1, 3, -1, -1, -1) if videos.shape[1] == 1 else videos
        try:
            feats = self.net(videos.contiguous(), rescale=True, resize=True, return_features=True)
        except torch.OutOfMemoryError:  # a RuntimeError too, but a matter of --batch_size, not of the file
            raise
        except RuntimeError as e:  # TorchScript's argument and shape errors
            raise UserError(f"--i3d {self.path}: not callable as StyleGAN-V's I3D, detector(videos, rescale=True, "
                            f"resize=True, return_features=True) ({str(e).strip().splitlines()[0]})") from None
        if not isinstance(feats, torch.Tensor) or tuple(feats.shape) != (len(videos), I3D_FEATURES):
            shape = tuple(feats.shape) if isinstance(feats, torch.Tensor) else type(feats).__name__
            raise UserError(f"--i3d {self.path}: gives features {shape} for {len(videos)} videos; FVD's I3D gives "
                            f"({len(videos)}, {I3D_FEATURES})")
        return {"pool": feats.float()}


def _first_frames(videos: np.ndarray, num_frames: int, where: str) -> np.ndarray:
    if videos.shape[1] < num_frames:
        raise UserError(f"{where}: videos of {videos.shape[1]} frames; FVD reads the first --num_frames "
                        f"{num_frames} (16 is the standard)")
    return videos[:, :num_frames]


def _read_video_set(source: str, num_frames: int, frame_interval: int, size: tuple[int, int]) -> np.ndarray:
    """The clips of a video data set (``clips`` or a CSV) as training reads them (``VideoDataset``: start frames
    from seed 0, stride ``frame_interval``, resized and centre-cropped), squares of the samples' ``size``."""
    from ditforge.data.sources import build_video_dataset

    if size[0] != size[1]:
        raise UserError(f"--ref {source}: a video data set is cropped to squares, the samples are {size[1]}x"
                        f"{size[0]}; give an .npz or a folder of videos of their size")
    data = build_video_dataset(source, num_frames, frame_interval, size[0], bad_samples_path=None)
    # (3, T, S, S) in [-1, 1], uint8 / 127.5 - 1 exactly: back to uint8 (T, S, S, 3)
    return np.stack([data[i]["video"].add(1).mul(127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
                     for i in range(len(data))])


def read_videos(source: str, flag: str, num_frames: int, frame_interval: int = 1,
                size: tuple[int, int] | None = None) -> np.ndarray:
    """The first ``num_frames`` frames of the videos of ``--samples`` or ``--ref``.

    Args:
        source: an .npz holding videos (N, T, H, W, C) uint8 under ``samples`` (as ``ditforge sample --save_npz``
            writes them for video models) or ``arr_0``; a folder of videos (``data.video.VIDEO_EXTENSIONS``,
            recursively, in sorted order, read with PyAV as RGB, frames as they are); or, for ``--ref`` only, a
            video data set, ``clips`` or a CSV (see ``_read_video_set``).
        flag: the flag named in errors.
        num_frames: frames kept per video.
        frame_interval: the stride of a data set's clips (npz and folders: consecutive frames).
        size: (H, W) of the samples, which a data set is resized to.

    Returns:
        (N, num_frames, H, W, C) uint8.

    Raises:
        UserError: a missing or unreadable file, an .npz without videos (N >= 2), a folder with fewer than 2
            videos, an unreadable one or videos of mixed sizes, videos shorter than ``num_frames``.
    """
    path = Path(source)
    if flag == "--ref" and (source == "clips" or path.suffix.lower() == ".csv"):
        return _read_video_set(source, num_frames, frame_interval, size)
    if path.is_dir():
        from ditforge.data.video import DECODE_ERRORS, VIDEO_EXTENSIONS, read_clip

        def first_frames(file: Path) -> np.ndarray:
            return read_clip(file, num_frames, 1, lambda max_start: 0)[0]

        return read_folder(path, flag, VIDEO_EXTENSIONS, first_frames, DECODE_ERRORS, "video")
    if not path.is_file():
        raise UserError(f"{flag} {source}: no such file or folder (expected an .npz of videos or a folder of videos"
                        f"{', or clips or a video CSV' if flag == '--ref' else ''})")
    where = f"{flag} {source}"
    return _first_frames(sample_array(read_npz(path, flag), where, video=True), num_frames, where)


def evaluate_fvd(samples: str, ref: str | None, i3d: str, num_frames: int = FVD_FRAMES, frame_interval: int = 1,
                 batch_size: int | None = None, device: torch.device | str = "cpu",
                 save_ref: str | None = None) -> dict[str, float | int | str]:
    """``ditforge eval --metrics fvd``: the FVD of the sample videos against the reference.

    Args:
        samples: see ``read_videos``.
        ref: see ``read_videos``, or an .npz of statistics ``--save_ref`` wrote (``mu``, ``sigma``; checked to be
            of the same extractor, frame size and ``num_frames``).
        i3d: the local ``i3d_torchscript.pt`` (``I3D``).
        num_frames: frames per video (the first ones).
        frame_interval: see ``read_videos``.
        batch_size: videos per I3D batch (default 8).
        save_ref: also write the reference statistics to this .npz, for a later ``--ref``.

    Returns:
        ``num_samples``, ``extractor`` (``i3d``), ``num_frames``, ``fvd`` (squared feature units).

    Raises:
        UserError: see ``read_videos`` and ``I3D``; no ``ref``; a reference of another frame size or frame count.
    """
    if ref is None:
        raise UserError("--ref: FVD needs a reference (an .npz of videos, a folder of videos, clips, a video CSV, or "
                        "statistics from --save_ref)")
    if num_frames < 1:
        raise UserError(f"--num_frames must be at least 1, got {num_frames}")
    batch_size = batch_size or FVD_BATCH_SIZE
    extractor = I3D(i3d, device)
    videos = read_videos(samples, "--samples", num_frames)
    size = videos.shape[2:4]

    def read_ref(source: str, flag: str) -> tuple[np.ndarray, None]:
        return read_videos(source, flag, num_frames, frame_interval, size), None

    reference = load_reference(ref, extractor, size, batch_size, read=read_ref)
    frames = int(reference.get("num_frames", -1))
    if frames != num_frames:
        raise UserError(f"--ref {ref}: statistics of {frames if frames > 0 else 'an unknown number of'}-frame clips, "
                        f"--num_frames is {num_frames}")
    if save_ref:
        log.info("wrote %s", save_reference(reference, save_ref))
    feats = extract_features(extractor, videos, {"pool"}, batch_size)["pool"]
    fvd = frechet_distance(*feature_statistics(feats), reference["mu"], reference["sigma"])
    return {"num_samples": len(videos), "extractor": extractor.name, "num_frames": num_frames, "fvd": fvd}
