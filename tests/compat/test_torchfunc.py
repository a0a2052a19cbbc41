"""torchfunc's hook tests, re-expressed with this package's bulk collectors.

Source: https://github.com/szymonmaszke/torchfunc at commit
92511c9beb2b62bb4e195deb0fa87b450daee61c, files ``tests/hooks/recorders_test.py`` (5 tests) and
``tests/hooks/registrators_test.py`` (3 tests); the behaviours they rely on are in
``torchfunc/hooks/recorders.py`` and ``torchfunc/hooks/registrators.py``.

Both peer files build the same MNIST-sized MLP and run 1000 forwards of one sample; so do the
fixtures here. torchfunc's ``ForwardPre`` is this package's ``ForwardInputsCollector`` (also
importable as ``ForwardPre``). torchfunc's registrators register one user hook on modules chosen by
type/index; this package has no registrator (a plain ``register_forward_hook`` does that): the
behaviour their tests check (one call per chosen module per forward, selection by type, ``len``,
``remove``) is re-expressed with a collector whose ``condition`` (asked once per call) counts
the calls.

=======================================  ==================================================
torchfunc test                           covered by
=======================================  ==================================================
recorders_test::test_len                 test_len
recorders_test::test_shapes              test_shapes
recorders_test::test_samples             test_samples
recorders_test::test_save                test_save_one_tensor_file_per_subrecorder;
                                         ``save(path, mkdir=True)``: test_save_mkdir;
                                         "the folder holds 2 files": test_saved_folder_holds_
                                         only_the_tensors (with ``index=False``)
recorders_test::test_remove              test_remove
registrators_test::test_hook_calls       test_registrator_hook_calls
registrators_test::test_len              test_registrator_len
registrators_test::test_remove           test_registrator_remove
(``data_method`` of every recorder in    test_data_method
recorders.py, not tested by torchfunc)
=======================================  ==================================================

Documented differences (``docs/bulk.md``): collectors index subrecorders in registration order
and record the whole output tensor unless ``data_method`` is given; ``save`` adds a hidden
``.index.json`` unless ``index=False``; hooks go away on ``release()``, at the end of a
``with`` block or on garbage collection, so each test here releases its collector.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_recorder.bulk import (
    ForwardInputsCollector,
    ForwardOutput,
    ForwardOutputsCollector,
    ForwardPre,
    load_collected,
)

CALLS = 1000


def mnist_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10)
    )


@pytest.fixture
def recorder() -> Iterator[ForwardInputsCollector]:
    """Sum of the inputs of children 2 and 3 (Linear(100, 50) and the ReLU after it)."""
    torch.manual_seed(0)
    model = mnist_mlp()
    collector = ForwardPre(reduction=lambda x, y: x + y)
    collector.children(model, indices=(2, 3))
    for _ in range(CALLS):
        model(torch.randn(1, 784))
    yield collector
    collector.release()


def test_len(recorder: ForwardInputsCollector) -> None:
    assert len(recorder) == 2


def test_shapes(recorder: ForwardInputsCollector) -> None:
    assert recorder[0].shape == (1, 100)
    assert recorder[1].shape == (1, 50)


def test_samples(recorder: ForwardInputsCollector) -> None:
    assert recorder.samples(0) == CALLS
    samples = list(recorder.iter_samples())
    assert samples == [CALLS, CALLS]


def test_save_one_tensor_file_per_subrecorder(
    recorder: ForwardInputsCollector, tmp_path: Path
) -> None:
    folder = tmp_path / "TORCHFUNC_RECORDER"
    recorder.save(folder)
    tensors = sorted(folder.glob("*.pt"))
    assert [path.name for path in tensors] == ["0.pt", "1.pt"]
    for index, path in enumerate(tensors):
        # A save/load round trip of the same tensor: exact equality is expected.
        assert torch.equal(torch.load(path, weights_only=True), recorder[index])


def test_save_mkdir(recorder: ForwardInputsCollector, tmp_path: Path) -> None:
    folder = tmp_path / "TORCHFUNC_RECORDER"
    recorder.save(folder, mkdir=True)
    assert sorted(path.name for path in folder.glob("*.pt")) == ["0.pt", "1.pt"]
    existing = tmp_path / "existing"
    existing.mkdir()
    recorder.save(existing, mkdir=False)
    assert sorted(path.name for path in existing.glob("*.pt")) == ["0.pt", "1.pt"]


def test_saved_folder_holds_only_the_tensors(
    recorder: ForwardInputsCollector, tmp_path: Path
) -> None:
    folder = tmp_path / "TORCHFUNC_RECORDER"
    recorder.save(folder, index=False)  # torchfunc's exact layout: the tensor files only
    assert len(list(folder.iterdir())) == 2  # torchfunc's own check
    with_index = tmp_path / "with_index"
    recorder.save(with_index)  # the default adds a hidden index, unseen by a shell-style glob
    assert len(glob.glob(os.path.join(with_index, "*"))) == 2
    assert len(list(with_index.glob("*.pt"))) == 2
    assert sorted(path.name for path in with_index.iterdir()) == [".index.json", "0.pt", "1.pt"]
    # Both folders read back; without the index the module names are unknown.
    assert [r.name for r in load_collected(with_index)] == ["2", "3"]
    plain = load_collected(folder)
    assert [(r.index, r.name, r.samples) for r in plain] == [(0, None, None), (1, None, None)]
    for old, new in zip(load_collected(with_index), plain, strict=True):
        torch.testing.assert_close(new.data, old.data, rtol=0, atol=0)  # the same saved tensor


def test_remove(recorder: ForwardInputsCollector) -> None:
    removed = recorder.remove(0)
    assert removed.shape == (1, 100)
    assert len(recorder) == 1


def test_data_method() -> None:
    model = mnist_mlp()
    x = torch.randn(4, 784)
    batch_inputs = ForwardPre(data_method="batch").children(model, indices=(0,))
    first_rows = ForwardOutput(data_method="sample").children(model, indices=(0,))
    whole = ForwardOutput(data_method="batch").children(model, indices=(0,))
    collectors = (batch_inputs, first_rows, whole)
    try:
        with torch.no_grad():
            out = model[0](x)
        # 'batch': the whole data object (the inputs tuple, the output tensor).
        assert isinstance(batch_inputs[0][0], tuple) and len(batch_inputs[0][0]) == 1
        # detach=True (the default here) records a detached view of x: the same values.
        torch.testing.assert_close(batch_inputs[0][0][0], x, rtol=0, atol=0)
        torch.testing.assert_close(whole[0][0], out, rtol=0, atol=0)  # same kernel, same input
        # 'sample': only the first item of the data (for a tensor, its first row).
        torch.testing.assert_close(first_rows[0][0], out[0], rtol=0, atol=0)
        first_rows.set_data_method("batch")
        model[0](x)
        assert first_rows[0][1].shape == (4, 100)
        with pytest.raises(ValueError, match="data_method"):
            ForwardPre(data_method="rows")  # type: ignore[arg-type]
    finally:
        for collector in collectors:
            collector.release()


# ---------------------------------------------------------------- registrators_test.py


class CallCounter:
    """torchfunc's test hook: counts its calls, ``int()`` gives the count."""

    def __init__(self) -> None:
        self.counter = 0

    def __call__(self, *_: object) -> bool:
        self.counter += 1
        return False  # as a collector condition: count, record nothing

    def __int__(self) -> int:
        return self.counter


Registered = tuple[ForwardOutputsCollector, CallCounter, nn.Module]


@pytest.fixture
def registrator() -> Iterator[Registered]:
    torch.manual_seed(0)
    model = mnist_mlp()
    hook = CallCounter()
    collector = ForwardOutputsCollector(condition=hook).modules(model, types=(nn.Linear,))
    for _ in range(CALLS):
        model(torch.randn(1, 784))
    yield collector, hook, model
    collector.release()


def test_registrator_hook_calls(registrator: Registered) -> None:
    collector, hook, _ = registrator
    assert int(hook) == 3 * CALLS
    assert collector.names == ("0", "2", "4")  # the three Linear layers, found by type


def test_registrator_len(registrator: Registered) -> None:
    collector, _, _ = registrator
    assert len(collector) == 3


def test_registrator_remove(registrator: Registered) -> None:
    collector, hook, model = registrator
    collector.remove(0)
    assert len(collector) == 2
    before = int(hook)
    model(torch.randn(1, 784))
    assert int(hook) == before + 2  # the removed module's hook is gone: two calls per forward
