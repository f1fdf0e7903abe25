"""``ditforge eval`` with Inception-v3 weights from a local file (random weights, saved here), and bad input:
one line on stderr naming the flag or file, exit code 2."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli


def _save_images(folder, images):
    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        Image.fromarray(image).save(folder / f"{i:03d}.png")
    return folder


def _random_images(n, size, channels=3):
    return np.random.default_rng().integers(0, 256, (n, size, size, channels), dtype=np.uint8)


@pytest.fixture(scope="module")
def random_inception(tmp_path_factory):
    """torch-fidelity's Inception-v3 with its random initial weights, as a state-dict file."""
    fe = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")

    class Untrained(fe.FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):  # keep the random initial weights
            return None

    folder = tmp_path_factory.mktemp("inception")
    torch.save({}, folder / "empty.pth")  # the constructor insists on reading a file
    net = Untrained("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(folder / "empty.pth"))
    torch.save(net.state_dict(), folder / "inception.pth")
    return folder / "inception.pth"


def test_random_inception_gives_finite_metrics(random_inception, tmp_path, capsys):
    samples, ref = tmp_path / "samples.npz", _save_images(tmp_path / "ref", _random_images(5, 32))
    np.savez(samples, arr_0=_random_images(4, 32))  # the ADM layout
    assert cli.main(["eval", "--samples", str(samples), "--ref", str(ref), "--inception", str(random_inception),
                     "--device", "cpu", "--batch_size", "3"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result.pop("extractor") == "inception" and result.pop("num_samples") == 4
    assert set(result) == {"fid", "sfid", "is", "precision", "recall"}
    assert all(math.isfinite(v) for v in result.values()), result
    assert result["fid"] > 0 and result["sfid"] > 0 and result["is"] > 1 - 1e-9  # IS >= 1: KL >= 0
    from ditforge.eval.fid import InceptionV3

    feats = InceptionV3(random_inception)(torch.from_numpy(_random_images(2, 32)).permute(0, 3, 1, 2))
    assert {k: tuple(v.shape) for k, v in feats.items()} == {"pool": (2, 2048), "logits": (2, 1008),
                                                              "spatial": (2, 17 * 17 * 7)}
    assert all(v.isfinite().all() and v.std() > 0 for v in feats.values())


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _write(path, data):
    path.write_bytes(data)
    return path


def _digits_npz(t):
    return _npz(t / "digits.npz", samples=_random_images(4, 8, 1))


def _mixed_folder(t):
    return str(_save_images(t / "mixed", list(_random_images(2, 8)) + list(_random_images(1, 9))))


# name: (argv of tmp_path, what the error line must name)
BAD = {
    "npz without samples": (lambda t: ["--samples", _npz(t / "x.npz", images=_random_images(3, 8)), "--ref", "digits"],
                            "no samples array"),
    "samples not uint8 images": (lambda t: ["--samples", _npz(t / "f.npz", samples=np.ones((3, 8, 8, 1), np.float32)),
                                            "--ref", "digits"], "uint8"),
    "folder of mixed sizes": (lambda t: ["--samples", _mixed_folder(t), "--ref", "digits"], "mixed sizes"),
    "reference of another resolution": (lambda t: ["--samples", _digits_npz(t), "--ref",
                                                   str(_save_images(t / "big", _random_images(3, 16)))], "16x16"),
    "no such samples": (lambda t: ["--samples", str(t / "nope.npz"), "--ref", "digits"], "nope.npz"),
    "missing inception file": (lambda t: ["--samples", _digits_npz(t), "--ref", "digits", "--inception",
                                          str(t / "pt_inception.pth")], "weights-inception-2015-12-05-6726825d.pth"),
    "inception file of garbage": (lambda t: ["--samples", _digits_npz(t), "--ref", "digits", "--inception",
                                             str(_write(t / "garbage.pth", b"not a checkpoint"))], "garbage.pth"),
    "unknown metric": (lambda t: ["--samples", _digits_npz(t), "--ref", "digits", "--metrics", "fid,kid"],
                       "--metrics kid"),
    "sfid without inception": (lambda t: ["--samples", _digits_npz(t), "--ref", "digits", "--metrics", "sfid"],
                               "--metrics sfid"),
    "accuracy without labels": (lambda t: ["--samples", _digits_npz(t), "--ref", "digits", "--metrics", "accuracy"],
                                "no labels"),
    "large images without inception": (lambda t: ["--samples", _npz(t / "big.npz", arr_0=_random_images(3, 16)),
                                                  "--ref", "digits"], "--inception"),
}


def _check_one_line_exit_2(argv, names, capsys):
    assert cli.main(["eval", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ditforge eval: error:") and names in err, err


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    argv, names = BAD[case]
    _check_one_line_exit_2(argv(tmp_path), names, capsys)


def test_inception_weights_of_the_wrong_shape(random_inception, tmp_path, capsys):
    state = torch.load(random_inception, weights_only=True)
    state["fc.weight"] = torch.randn(1000, 2048)  # torchvision's ImageNet head, not the 1008 classes of TF's
    torch.save(state, tmp_path / "wrong.pth")
    samples = _npz(tmp_path / "s.npz", samples=_random_images(3, 8))
    _check_one_line_exit_2(["--samples", samples, "--ref", "digits", "--inception", str(tmp_path / "wrong.pth")],
                           "wrong.pth", capsys)
