"""DevicePrefetcher hands out the loader's batches unchanged and in order; its CUDA path (pinned buffers reused,
copies on a side stream) is checked against the same batches on the GPU by benchmarks/data_loading.py."""

import torch

from ditforge.data.prefetch import DevicePrefetcher, copy_bytes, default_num_workers


def _batches(n: int):
    g = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(3, 2, 4, generator=g), "label": torch.randint(0, 9, (3,), generator=g),
             "text": ["a", "b", "c"], "cond": {"y": torch.randn(3, 5, generator=g)}} for _ in range(n)]


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k])
        elif isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        else:
            assert a[k] == b[k]


def test_batches_pass_through_in_order():
    for depth in (0, 1, 3):
        source = _batches(5)
        out = list(DevicePrefetcher(source, torch.device("cpu"), depth=depth))
        assert len(out) == 5
        for a, b in zip(out, source):
            _assert_same(a, b)


def test_tuples_and_plain_values():
    x, y = torch.randn(2, 3), torch.tensor([1, 2])
    (got,) = list(DevicePrefetcher([(x, y)], torch.device("cpu")))
    assert isinstance(got, tuple) and torch.equal(got[0], x) and torch.equal(got[1], y)


def test_default_num_workers_shares_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(32)), raising=False)
    assert default_num_workers(1) == 8  # capped
    assert default_num_workers(8) == 3  # 4 cores per process, one for the trainer
    assert default_num_workers(64) == 1  # never 0: files are decoded off the training process


def test_copy_bytes_equals_copy():
    g = torch.Generator().manual_seed(3)
    for src in (torch.randn(5, 3, generator=g).to(torch.bfloat16), torch.randint(0, 9, (7,), generator=g),
                torch.randn(4, 6, generator=g).t(), torch.rand(3, 2, generator=g) < 0.5, torch.tensor(2.5)):
        dst = torch.empty(src.shape, dtype=src.dtype)
        copy_bytes(dst, src)
        assert torch.equal(dst, src)
