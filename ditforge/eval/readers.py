"""Reading the sets ``ditforge eval`` compares: samples and references as .npz arrays, folders of files (images
here, videos through ``fvd.read_videos``) or the built-in ``digits``, and reference statistics stored or computed
(``load_reference``)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from ditforge.errors import UserError
from ditforge.eval.fid import extract_features, reference_statistics

SAMPLE_KEYS = ("arr_0", "samples")  # ADM's evaluator reads arr_0; `ditforge sample --save_npz` writes samples
LABEL_KEYS = ("labels", "arr_1")  # ADM's labelled batches hold the labels as arr_1


def read_npz(path: Path, flag: str) -> dict[str, np.ndarray]:
    """All arrays of an .npz (no pickles). Raises UserError naming ``flag`` if it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return dict(npz)
    except (OSError, ValueError) as e:  # not a zip / npy, or object arrays
        raise UserError(f"{flag} {path}: not a readable .npz ({str(e).splitlines()[0]})") from None


def sample_array(arrays: dict[str, np.ndarray], where: str, video: bool = False) -> np.ndarray:
    """The samples of an .npz's arrays: ``arr_0`` or ``samples``, images (N, H, W, C) (videos: (N, T, H, W, C))
    uint8 with C 1 or 3 and N >= 2. Raises UserError naming ``where`` otherwise."""
    key = next((k for k in SAMPLE_KEYS if k in arrays), None)
    if key is None:
        raise UserError(f"{where}: no samples array (expected 'arr_0' as the ADM evaluator reads it, or 'samples' "
                        f"as ditforge sample --save_npz writes it; it holds {', '.join(arrays) or 'nothing'})")
    images = arrays[key]
    ndim, layout = (5, "videos (N, T, H, W, C)") if video else (4, "images (N, H, W, C)")
    if images.dtype != np.uint8 or images.ndim != ndim or images.shape[-1] not in (1, 3) or len(images) < 2:
        hint = "; videos are measured with --metrics fvd --i3d" if not video and images.ndim == 5 else ""
        raise UserError(f"{where}: '{key}' must be {layout} uint8 with C 1 or 3 and N >= 2, got "
                        f"{images.shape} {images.dtype}{hint}")
    return images


IMAGE_ERRORS = (OSError, ValueError, SyntaxError)  # PIL raises all three on bad files


def read_image(file: Path) -> np.ndarray:
    """An image file as (H, W, 3) uint8 RGB; raises one of ``IMAGE_ERRORS`` if unreadable."""
    from PIL import Image

    with Image.open(file) as img:
        return np.asarray(img.convert("RGB"))


def read_folder(folder: Path, flag: str, extensions: Collection[str], read: Callable[[Path], np.ndarray],
                errors: tuple[type[Exception], ...], noun: str) -> np.ndarray:
    """The files of ``folder`` with one of ``extensions`` (recursively, in sorted order), each read with
    ``read(path) -> array``, stacked. Raises UserError naming ``flag``: fewer than 2 files, one that ``read``
    fails on with ``errors``, or arrays of mixed shapes ((..., H, W, C): reported as sizes W x H)."""
    files = sorted(f for f in folder.rglob("*") if f.suffix.lower() in extensions and f.is_file())
    if len(files) < 2:
        raise UserError(f"{flag} {folder}: fewer than 2 {noun}s ({', '.join(sorted(extensions))})")
    arrays = []
    for f in files:
        try:
            arrays.append(read(f))
        except errors as e:
            raise UserError(f"{flag} {f}: unreadable {noun} ({e})") from None
        if arrays[-1].shape != arrays[0].shape:
            (h0, w0), (h, w) = arrays[0].shape[-3:-1], arrays[-1].shape[-3:-1]
            raise UserError(f"{flag} {folder}: {noun}s of mixed sizes ({files[0].name} is {w0}x{h0}, {f.name} is "
                            f"{w}x{h}); crop or resize them to one size first")
    return np.stack(arrays)


def read_images(source: str, flag: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The images of ``--samples`` or ``--ref``.

    Args:
        source: ``digits`` (the 1,797 real digits), a folder (its images, recursively, in sorted order; read as
            RGB), or an .npz holding ``arr_0`` or ``samples`` and optionally ``labels`` or ``arr_1``.
        flag: the flag named in errors.

    Returns:
        Images (N, H, W, C) uint8 and labels (N,) int64 or None.

    Raises:
        UserError: a missing or unreadable file, an .npz without images (or with images not (N, H, W, C) uint8),
            a folder with fewer than 2 images, an unreadable one, or images of mixed sizes.
    """
    if source == "digits":
        from ditforge.eval.digits import real_digits_uint8

        return real_digits_uint8()
    path = Path(source)
    if path.is_dir():
        from ditforge.data.images import IMAGE_EXTENSIONS

        return read_folder(path, flag, IMAGE_EXTENSIONS, read_image, IMAGE_ERRORS, "image"), None
    if not path.is_file():
        raise UserError(f"{flag} {source}: no such file or folder (expected an .npz, an image folder or 'digits')")
    arrays = read_npz(path, flag)
    images = sample_array(arrays, f"{flag} {source}")
    labels = next((arrays[k].astype(np.int64) for k in LABEL_KEYS if k in arrays), None)
    return images, labels


def _check_size(size, expected, where: str) -> None:
    if tuple(int(s) for s in size) != tuple(expected):
        raise UserError(f"{where}: images of {size[1]}x{size[0]}, the samples are {expected[1]}x{expected[0]}; "
                        "compare sets of one resolution")


def load_reference(source: str, extractor, image_size: tuple[int, int], batch_size: int,
                   read=read_images) -> dict[str, np.ndarray]:
    """Reference statistics (see ``fid.reference_statistics``) for ``--ref``: read from an .npz that holds them
    (``mu``: written by ``--save_ref``, or one of ADM's reference batches, whose ``arr_0`` images then give the
    features of precision / recall), else computed from the images (or videos) ``read(source, "--ref")`` gives
    (``read_images``; ``fvd.read_videos``).

    Raises:
        UserError: as ``read``; statistics of another extractor; images of another size than ``image_size``
            (H, W).
    """
    path = Path(source)
    if path.suffix == ".npz" and path.is_file():
        arrays = read_npz(path, "--ref")
        if "mu" in arrays:
            name = str(arrays.get("extractor", "inception"))  # ADM's reference batches are Inception's
            if name != extractor.name:
                raise UserError(f"--ref {source}: statistics of the {name} extractor, these samples are measured "
                                f"with the {extractor.name} one (--inception, --i3d)")
            if "pool" not in arrays and any(k in arrays for k in SAMPLE_KEYS):
                images = sample_array(arrays, f"--ref {source}")
                _check_size(images.shape[1:3], image_size, f"--ref {source}")
                arrays["pool"] = extract_features(extractor, images, {"pool"}, batch_size)["pool"]
                arrays["image_size"] = np.array(images.shape[1:3])
            if "image_size" in arrays:
                _check_size(arrays["image_size"], image_size, f"--ref {source}")
            return arrays
    images, _ = read(source, "--ref")
    _check_size(images.shape[-3:-1], image_size, f"--ref {source}")
    return reference_statistics(extractor, images, batch_size)


def read_prompts(samples: str) -> list[str]:
    """The prompts of a text-to-image sample .npz (``prompts`` (N,) str, as ``ditforge sample --save_npz`` writes
    them). Raises UserError if there are none."""
    path = Path(samples)
    if path.suffix == ".npz" and path.is_file():  # (read_images checked it reads) only this array, not the images again
        with np.load(path, allow_pickle=False) as npz:
            if "prompts" in npz.files:
                return [str(p) for p in npz["prompts"]]
    raise UserError(f"--metrics clip: --samples {samples} holds no 'prompts' (ditforge sample --prompt ... "
                    "--save_npz writes them)")
