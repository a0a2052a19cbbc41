"""The capture path of module recorders: a one-tensor record and a structured record get the
same options (detach, clone, device, dtype, keep, the in-place check); a recorder's ``capture``
replaced on the instance is the one its hooks call; a manager records for the thread that
started it."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_recorder import ModuleOutputsRecorder, RecorderManager, RecordModifiedError


class Pair(nn.Module):
    """Returns its input transformed twice: once as a tensor, once inside a tuple."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.pair = Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.pair(self.lin(x))
        return a + b


OPTIONS = [
    {},
    {"detach": True},
    {"clone": True},
    {"detach": True, "clone": True},
    {"dtype": "float64"},
    {"detach": True, "device": "cpu"},
    {"detach": True, "clone": True, "dtype": "float16"},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "none")
def test_tensor_and_tuple_records_get_the_same_options(options: dict[str, Any]) -> None:
    net = Net()
    single = ModuleOutputsRecorder("lin", **options).initialize(net)
    nested = ModuleOutputsRecorder("pair", **options).initialize(net)
    x = torch.randn(2, 3)
    outputs: dict[str, Any] = {}
    hooks = [
        net.lin.register_forward_hook(lambda m, a, o: outputs.__setitem__("lin", o)),
        net.pair.register_forward_hook(lambda m, a, o: outputs.__setitem__("pair", o)),
    ]
    try:
        with single, nested:
            net(x)
        tensor_record = single.get_record_data()
        tuple_record = nested.get_record_data()
    finally:
        for hook in hooks:
            hook.remove()
        single.release()
        nested.release()
    dtype = {"float64": torch.float64, "float16": torch.float16}.get(options.get("dtype", ""))
    pairs = [(tensor_record, outputs["lin"]), *zip(tuple_record, outputs["pair"], strict=True)]
    for record, output in pairs:
        assert isinstance(record, torch.Tensor)
        assert record.dtype == (dtype or output.dtype)
        # a float16 cast rounds; a float64 cast and no cast are exact
        atol = 1e-3 if dtype == torch.float16 else 0.0
        torch.testing.assert_close(record, output.to(record.dtype), atol=atol, rtol=atol)
        detached = options.get("detach", False)
        assert record.requires_grad == (not detached and output.requires_grad)
        copied = options.get("clone", False) or dtype is not None
        assert (record.data_ptr() != output.data_ptr()) == copied
        if not options:
            assert record is output  # no option: the output itself


def test_in_place_change_is_detected_in_tensor_and_tuple_records() -> None:
    for source, index in [("lin", None), ("pair", 0)]:
        net = Net()
        recorder = ModuleOutputsRecorder(source).initialize(net)
        with recorder, torch.no_grad():
            net(torch.randn(2, 3))
        record = recorder.streams[source]._records[0]
        (record if index is None else record[index]).add_(1)
        with pytest.raises(RecordModifiedError, match="modified in place"):
            recorder.get_record_data()
        recorder.release()


def test_inference_tensors_are_recorded_without_a_version_check() -> None:
    net = Net()
    recorder = ModuleOutputsRecorder("lin", detach=True).initialize(net)
    with recorder, torch.inference_mode():
        net(torch.randn(2, 3))
    stream = recorder.streams["lin"]
    assert stream._versions == [None] and stream._records[0].is_inference()
    recorder.release()


def test_keep_counts_every_call_on_the_tensor_path() -> None:
    net = nn.Sequential(nn.Linear(2, 2))
    recorder = ModuleOutputsRecorder("0", keep=2, detach=True).initialize(net)
    xs = [torch.full((1, 2), float(i)) for i in range(4)]
    with recorder:
        outs = [net(x) for x in xs]
    stream = recorder.streams["0"]
    assert stream.num_calls == 4 and len(stream) == 2
    for record, out in zip(stream.data_buffer, outs[:2], strict=True):
        assert torch.equal(record, out.detach())
    recorder.release()


def test_capture_replaced_on_the_instance_is_what_the_hooks_call() -> None:
    net = Net()
    recorder = ModuleOutputsRecorder("lin", detach=True).initialize(net)
    seen: list[tuple[str, torch.Tensor]] = []

    def capture(stream: Any, value: Any) -> None:  # what a monitor installs on its recorders
        stream.num_calls += 1
        seen.append((stream.name, value))

    recorder.capture = capture  # type: ignore[method-assign]
    with recorder:
        out = net.lin(torch.randn(2, 3))
    assert [name for name, _ in seen] == ["lin"] and seen[0][1] is out
    assert recorder.streams["lin"].num_calls == 1 and len(recorder.streams["lin"]) == 0
    recorder.release()


def test_a_manager_records_only_the_calls_of_the_thread_that_started_it() -> None:
    net = Net()
    manager = RecorderManager({"lin": {"type": "ModuleOutputs", "source": "lin"}})
    manager.initialize(net)
    caught: list[warnings.WarningMessage] = []

    def other_thread() -> None:
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always")
            net(torch.randn(5, 3))
        caught.extend(found)

    try:
        with manager:
            net(torch.randn(2, 3))
            worker = threading.Thread(target=other_thread, name="worker")
            worker.start()
            worker.join(60)
            assert not worker.is_alive()
            net(torch.randn(3, 3))
        records = manager.get_recorder("lin").data_buffer
    finally:
        manager.release()
    assert [r.shape[0] for r in records] == [2, 3]  # the worker's call (5 rows) is not recorded
    assert any("was not recorded" in str(w.message) for w in caught)


def test_reinstalling_a_hook_that_would_displace_another_raises() -> None:
    from functools import partial

    from torch.utils.hooks import RemovableHandle

    from lightning_recorder._core.hooks import HookSet
    from lightning_recorder.errors import RecorderStateError

    class Rewinding(nn.Linear):
        """Hands its new hook the id of the newest hook already there (what a counter that
        could not be advanced would do)."""

        def register_forward_hook(self, *args: Any, **kwargs: Any) -> RemovableHandle:
            RemovableHandle.next_id = max(self._forward_hooks, default=RemovableHandle.next_id)
            return super().register_forward_hook(*args, **kwargs)

    model = Rewinding(2, 2)
    user = model.register_forward_hook(lambda m, a, o: None)
    with HookSet("test") as hooks, pytest.raises(RecorderStateError, match="took the id"):
        hooks.install(partial(model.register_forward_hook, lambda m, a, o: None))
    user.remove()
    assert not model._forward_hooks
