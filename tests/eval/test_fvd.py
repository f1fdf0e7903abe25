"""``ditforge eval --metrics fvd --i3d`` with a tiny random I3D stand-in: a TorchScript module of StyleGAN-V's
call signature (``detector(videos, rescale=, resize=, return_features=)`` -> (B, 400)) saved to a file. FVD is
checked against the Fréchet distance of the module's own features in float64 by the eigenvalue closed form;
video folders and CSVs (lossless FFV1) against the frames written; bad input: one line, exit code 2."""

from __future__ import annotations

import json

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ditforge import cli
from ditforge.eval.fvd import read_videos


class TinyI3D(torch.nn.Module):
    """Random 3-D convs, pooling and a linear layer to 400 features. The real I3D resizes frames to 224x224; this
    one to 16x16, to stay cheap. 32 x 2 x 4 x 4 = 1024 pooled features > 400, so the features' covariance has full
    rank once there are more than 400 videos."""

    def __init__(self, width: int = 400):
        super().__init__()
        self.conv1 = torch.nn.Conv3d(3, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv3d(16, 32, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(32 * 2 * 4 * 4, width)

    def forward(self, x: torch.Tensor, rescale: bool = False, resize: bool = False, return_features: bool = False):
        x = x.float()
        if rescale:
            x = x / 127.5 - 1
        if resize:
            x = F.interpolate(x, size=(x.shape[2], 16, 16), mode="trilinear", align_corners=False)
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        logits = self.fc(F.adaptive_avg_pool3d(x, (2, 4, 4)).flatten(1))
        return logits if return_features else logits.softmax(-1)


class NoKeywords(torch.nn.Module):
    def forward(self, x: torch.Tensor):
        return x.float().mean((2, 3, 4))


def _script(module, path):
    torch.jit.script(module.eval()).save(str(path))
    return path


@pytest.fixture(scope="module")
def i3d(tmp_path_factory):
    return _script(TinyI3D(), tmp_path_factory.mktemp("i3d") / "i3d_torchscript.pt")


def _videos(n, frames=5, size=8, high=256):
    return np.random.default_rng().integers(0, high, (n, frames, size, size, 3), dtype=np.uint8)


def _fvd_float64(i3d_path, samples, ref):
    # The module's features of the first 4 frames, their float64 statistics, and the Fréchet distance with
    # Tr((S1 S2)^(1/2)) = sum of sqrt(eig(S1^(1/2) S2 S1^(1/2))), both roots by eigh (not scipy's sqrtm).
    net = torch.jit.load(str(i3d_path))
    with torch.no_grad():
        f1, f2 = (net(torch.from_numpy(v[:, :4]).permute(0, 4, 1, 2, 3), rescale=True, resize=True,
                      return_features=True).double().numpy() for v in (samples, ref))
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    w, v = np.linalg.eigh(s1)
    root1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = np.linalg.eigvalsh(root1 @ s2 @ root1)
    return (mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(np.clip(inner, 0, None)).sum()


def _eval(argv, capsys):
    assert cli.main(["eval", *argv, "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_fvd_matches_the_float64_frechet_distance_of_the_features(i3d, tmp_path, capsys):
    samples, ref = _videos(450), _videos(500, high=200)  # another distribution: darker
    np.savez(tmp_path / "samples.npz", samples=samples)  # as ditforge sample --save_npz writes video samples
    np.savez(tmp_path / "ref.npz", arr_0=ref)
    common = ["--i3d", str(i3d), "--num_frames", "4", "--batch_size", "64"]
    same = _eval(["--samples", str(tmp_path / "samples.npz"), "--ref", str(tmp_path / "samples.npz"), *common], capsys)
    assert same["num_samples"] == 450 and same["num_frames"] == 4 and same["extractor"] == "i3d"
    assert abs(same["fvd"]) < 1e-6, same
    result = _eval(["--samples", str(tmp_path / "samples.npz"), "--ref", str(tmp_path / "ref.npz"), *common,
                    "--save_ref", str(tmp_path / "stats.npz")], capsys)
    expected = _fvd_float64(i3d, samples, ref)
    assert expected > 1e-3 and result["fvd"] == pytest.approx(expected, rel=1e-6), (result, expected)
    cached = _eval(["--samples", str(tmp_path / "samples.npz"), "--ref", str(tmp_path / "stats.npz"), *common], capsys)
    assert cached["fvd"] == pytest.approx(result["fvd"], rel=1e-9)


def _write_lossless(path, frames):
    # FFV1 in Matroska: lossless, so decoding gives the frames back exactly
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("ffv1", rate=8)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def test_video_folder_and_csv_give_the_first_frames(tmp_path):
    videos = _videos(3, frames=6)
    folder = tmp_path / "videos"
    folder.mkdir()
    for i, v in enumerate(videos):
        _write_lossless(folder / f"{i:02d}.mkv", v)
    np.testing.assert_array_equal(read_videos(str(folder), "--samples", 4), videos[:, :4])
    # a CSV is read as training reads it: at the samples' size already, crop and resize change nothing; clips of
    # 3 frames at stride 2 span the first 5 frames, and start from frame 0 or 1
    (tmp_path / "videos.csv").write_text("path,text\n" + "".join(f"videos/{i:02d}.mkv,clip {i}\n" for i in range(3)))
    clips = read_videos(str(tmp_path / "videos.csv"), "--ref", 3, frame_interval=2, size=(8, 8))
    assert clips.shape == (3, 3, 8, 8, 3)
    for clip, video in zip(clips, videos):
        assert any(np.array_equal(clip, video[start::2][:3]) for start in (0, 1))


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def _mixed_folder(t):
    (t / "mixed").mkdir()
    _write_lossless(t / "mixed" / "a.mkv", _videos(1)[0])
    _write_lossless(t / "mixed" / "b.mkv", _videos(1, size=10)[0])
    return str(t / "mixed")


def _state_dict_file(path):
    torch.save(TinyI3D().state_dict(), path)  # a plain zip of tensors: no TorchScript code in it
    return str(path)


def _samples(t):
    return _npz(t / "s.npz", samples=_videos(3))


# name: (argv of tmp_path and the I3D file, what the error line must name)
BAD = {
    "missing i3d file": (lambda t, i3d: ["--samples", _samples(t), "--ref", _samples(t), "--i3d",
                                         str(t / "nope.pt")], "i3d_torchscript.pt"),
    "i3d file not TorchScript": (lambda t, i3d: ["--samples", _samples(t), "--ref", _samples(t), "--i3d",
                                                 _state_dict_file(t / "sd.pt")],
                                 "sd.pt: not a TorchScript file"),
    "i3d of the wrong output width": (lambda t, i3d: ["--samples", _samples(t), "--ref", _samples(t), "--num_frames",
                                                      "4", "--i3d", str(_script(TinyI3D(width=399), t / "w.pt"))],
                                      "(3, 400)"),
    "i3d of another call": (lambda t, i3d: ["--samples", _samples(t), "--ref", _samples(t), "--i3d",
                                            str(_script(NoKeywords(), t / "k.pt")), "--num_frames", "4"],
                            "k.pt: not callable"),
    "npz of images": (lambda t, i3d: ["--samples", _npz(t / "im.npz", samples=_videos(3)[:, 0]), "--ref",
                                      _samples(t), "--i3d", str(i3d)], "must be videos (N, T, H, W, C)"),
    "npz without samples": (lambda t, i3d: ["--samples", _npz(t / "x.npz", videos=_videos(3)), "--ref",
                                            _samples(t), "--i3d", str(i3d)], "no samples array"),
    "too few frames": (lambda t, i3d: ["--samples", _samples(t), "--ref", _samples(t), "--i3d", str(i3d)],
                       "videos of 5 frames; FVD reads the first --num_frames 16"),
    "folder of mixed sizes": (lambda t, i3d: ["--samples", _mixed_folder(t), "--ref", _samples(t), "--i3d",
                                              str(i3d), "--num_frames", "4"], "videos of mixed sizes"),
    "reference of another size": (lambda t, i3d: ["--samples", _samples(t), "--ref",
                                                  _npz(t / "r.npz", arr_0=_videos(3, size=16)), "--i3d", str(i3d),
                                                  "--num_frames", "4"], "16x16"),
    "statistics of other clips": (lambda t, i3d: ["--samples", _samples(t), "--ref", _npz(
        t / "st.npz", mu=np.zeros(400), sigma=np.eye(400), extractor=np.array("i3d"), image_size=np.array([8, 8]),
        num_frames=np.array(4)), "--i3d", str(i3d), "--num_frames", "5"], "statistics of 4-frame clips"),
    "fvd with another metric": (lambda t, i3d: ["--samples", _samples(t), "--ref", _samples(t), "--i3d", str(i3d),
                                                "--metrics", "fvd,fid"], "--metrics fvd: measured alone"),
    "fvd without i3d": (lambda t, i3d: ["--samples", _samples(t), "--ref", _samples(t), "--metrics", "fvd"],
                        "with --i3d"),
    "video samples without fvd": (lambda t, i3d: ["--samples", _samples(t), "--ref", "digits"], "--metrics fvd"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2(case, i3d, tmp_path, capsys):
    argv, names = BAD[case]
    assert cli.main(["eval", *argv(tmp_path, i3d), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ditforge eval: error:") and names in err, err


def test_the_npz_ditforge_sample_writes_for_a_video_model(i3d, tmp_path, capsys):
    # A tiny class-conditional video model (random init), sampled at evaluation scale (arr_0: N, T, H, W, 3)
    from ditforge.models import create_model
    from ditforge.export import export_safetensors

    name, frames, size = "vDiT-T/122", 4, 8
    model = create_model(name, size, 3, 5, True, 0.1, num_frames=frames)
    config = {"model": dict(model=name, condition="class", vae="none", num_classes=5, learn_sigma=True,
                            class_dropout_prob=0.1, in_channels=3, input_size=size, num_frames=frames),
              "data": dict(image_size=size, num_frames=frames)}
    export_safetensors(model.state_dict(), config, tmp_path / "v.safetensors")
    assert cli.main(["sample", "--ckpt", str(tmp_path / "v.safetensors"), "--num_samples", "6", "--device", "cpu",
                     "--num_sampling_steps", "2", "--save_npz", str(tmp_path / "v.npz")]) == 0
    ref = _videos(8, frames=4)
    np.savez(tmp_path / "ref.npz", arr_0=ref)
    result = _eval(["--samples", str(tmp_path / "v.npz"), "--ref", str(tmp_path / "ref.npz"), "--i3d", str(i3d),
                    "--num_frames", "4"], capsys)
    with np.load(tmp_path / "v.npz") as f:
        samples = f["arr_0"]
    assert samples.shape == (6, 4, 8, 8, 3) and result["num_samples"] == 6
    # 6 and 8 videos: singular covariances, whose matrix roots agree less closely than full-rank ones
    assert result["fvd"] == pytest.approx(_fvd_float64(i3d, samples, ref), rel=1e-4)
