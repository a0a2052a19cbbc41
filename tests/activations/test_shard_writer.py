"""The activation writer around plain PyTorch: format, roll-over, queue, crash, resume, errors."""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import pickle
import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

import lightning_recorder
from lightning_recorder import (
    NoRecordError,
    RecorderConfigError,
    RecorderManager,
    RecorderStateError,
)
from lightning_recorder.activations import ActivationDataset, ShardWriter, concat_activations
from lightning_recorder.activations._format import Storage

ROOM = Path(lightning_recorder.__file__).parent / "activations"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _files(directory: Path, suffix: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(suffix))


def test_room_imports_neither_lightning_nor_recorder_modules() -> None:
    for path in ROOM.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                assert not module.startswith("lightning"), (path.name, module)
                if node.level == 2:  # from ..x: the error classes and the shared checks
                    assert module in ("..errors", ".._core.checks"), (path.name, module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("lightning") for a in node.names), path.name
    # the shared checks stand on torch and the error classes alone
    checks = ROOM.parent / "_core" / "checks.py"
    for node in ast.walk(ast.parse(checks.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.module == "errors" and node.level == 2, node.module
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.startswith("lightning") for n in names), names


def test_manager_loop_reads_back_bit_exact(tmp_path: Path) -> None:
    model = _net()
    data = torch.randn(20, 6)
    manager = RecorderManager(
        {
            "hidden": {"type": "ModuleOutputs", "source": "1", "detach": True},
            "logits": {"type": "ModuleOutputs", "source": "2", "detach": True},
        }
    )
    manager.initialize(model)
    try:
        with ShardWriter(tmp_path, run="plain", max_shard_bytes=300) as writer:
            for batch_idx in range(5):
                index = torch.arange(4 * batch_idx, 4 * batch_idx + 4)
                with manager:
                    model(data[index])
                assert (
                    writer.write_records(
                        manager, stage="predict", batch_idx=batch_idx, sample_index=index
                    )
                    == 2
                )
    finally:
        manager.release()
    assert writer.shards_written > 1  # rolled over at 300 bytes
    with torch.no_grad():  # the same modules, the same CPU kernels, the same inputs
        hidden = model[1](model[0](data))
        logits = model[2](hidden)
    assert torch.equal(concat_activations(tmp_path, "hidden"), hidden)
    assert torch.equal(concat_activations(tmp_path, "logits"), logits)
    dataset = ActivationDataset(tmp_path, sources="hidden")
    assert len(dataset) == 20
    item = dataset[13]
    assert torch.equal(item["activation"], hidden[13])
    assert (item["sample_index"], item["batch_idx"], item["module"], item["run"]) == (
        13,
        3,
        "1",
        "plain",
    )
    assert dataset.provenance()[13]["shape"] == [8]


def test_shards_are_plain_safetensors_with_a_json_index(tmp_path: Path) -> None:
    safe_open = pytest.importorskip("safetensors").safe_open  # the reference reader
    values = torch.arange(12, dtype=torch.float32).view(3, 4)
    with ShardWriter(tmp_path, run="spec", rank=2) as writer:
        writer.write(
            "feat",
            "fc",
            values,
            stage="val",
            global_step=7,
            epoch=1,
            batch_idx=4,
            sample_index=[10, 11, 12],
        )
    assert _files(tmp_path, "") == [
        "spec-rank00002-000000.index.json",
        "spec-rank00002-000000.safetensors",
    ]
    entry = json.loads((tmp_path / "spec-rank00002-000000.index.json").read_text())
    (chunk,) = entry["chunks"]
    assert entry["shard"] == "spec-rank00002-000000.safetensors"
    assert (entry["run"], entry["rank"], entry["generation"]) == ("spec", 2, 0)
    assert chunk["key"] == "feat/fc/0"
    assert chunk["stage"] == "val" and chunk["global_step"] == 7 and chunk["epoch"] == 1
    assert chunk["batch_idx"] == 4 and chunk["sample_index"] == [10, 11, 12]
    assert chunk["shape"] == [3, 4] and chunk["dtype"] == "float32"
    with safe_open(str(tmp_path / entry["shard"]), framework="pt") as handle:
        assert handle.metadata()["run"] == "spec"
        assert torch.equal(handle.get_tensor(chunk["key"]), values)


def test_source_options_tokens_mean_transform_dtype(tmp_path: Path) -> None:
    x = torch.randn(4, 5, 6)
    sources = {
        "cls": {"tokens": 0},
        "pooled": {"mean": 1, "dtype": "float16"},
        "pair": {"tokens": [0, -1], "transform": lambda t: t.flatten(1)},
    }
    with ShardWriter(tmp_path, sources=sources) as writer:
        for source in sources:
            writer.write(source, "enc", x, sample_index=range(4))
    assert torch.equal(concat_activations(tmp_path, "cls"), x[:, 0])
    # x.mean(1) then the cast, on the same tensor: the path the writer takes, exactly.
    assert torch.equal(concat_activations(tmp_path, "pooled"), x.mean(1).half())
    assert torch.equal(concat_activations(tmp_path, "pair"), x[:, [0, -1]].flatten(1))


def test_a_negative_mean_dimension_that_counts_back_to_the_rows_is_refused(
    tmp_path: Path,
) -> None:
    # `mean: -1` of a vector (or -2 of a matrix) averaged the rows of the batch into one row,
    # written without a word when no sample index was given
    writer = ShardWriter(tmp_path, run="r", sources={"s": {"mean": -1}, "m": {"mean": [-1, -2]}})
    for source, tensor, dim in (("s", torch.randn(4), -1), ("m", torch.randn(4, 3), -2)):
        with pytest.raises(
            RecorderConfigError,
            match=rf"Expected `mean` of source '{source}' to name dimensions other "
            rf"than 0 \(the rows\) but {dim} is dimension 0 of its activations of shape "
            rf"\({', '.join(map(str, tensor.shape))},?\)",
        ):
            writer.write(source, "x", tensor)
    writer.write("s", "x", torch.ones(4, 3))  # dimension -1 of a matrix is its columns
    writer.close()
    assert torch.equal(concat_activations(tmp_path, "s"), torch.ones(4))


def test_mean_of_integer_and_bool_activations_is_taken_in_float32(tmp_path: Path) -> None:
    """torch takes no mean of integers: a mask's mean is the fraction of its true values."""
    mask = torch.tensor([[True, False, True, True], [False, False, False, True]])
    ids = torch.tensor([[3, 4], [10, -1]])
    sources = {"mask": {"mean": 1}, "ids": {"mean": 1, "dtype": "float64"}}
    with ShardWriter(tmp_path, sources=sources) as writer:
        writer.write("mask", "m", mask, sample_index=range(2))
        writer.write("ids", "i", ids, sample_index=range(2))
    fraction = concat_activations(tmp_path, "mask")
    assert fraction.dtype == torch.float32 and fraction.tolist() == [0.75, 0.25]
    mean = concat_activations(tmp_path, "ids")
    assert mean.dtype == torch.float64 and mean.tolist() == [3.5, 4.5]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"tokens": [0, 7]},
            r"`tokens` of .*'enc'.* positions of dimension 1 of its activations, of size 5 "
            r"\(shape \(4, 5, 6\)\), so from -5 to 4, but got 7\.",
        ),
        ({"tokens": -6}, r"so from -5 to 4, but got -6\."),
        (
            {"mean": [1, 3]},
            r"`mean` of .*'enc'.* dimensions of its activations, which have 3 "
            r"\(shape \(4, 5, 6\)\), but got 3\.",
        ),
    ],
)
def test_source_options_outside_the_activations_are_refused(
    tmp_path: Path, options: dict[str, object], match: str
) -> None:
    """A position or dimension the activations do not have is a configuration error that says
    which option, the activations' shape and what would be right (it was torch's IndexError)."""
    x = torch.randn(4, 5, 6)
    with (
        ShardWriter(tmp_path, sources={"enc": options}) as writer,
        pytest.raises(RecorderConfigError, match=match),
    ):
        writer.write("enc", "enc", x, sample_index=range(4))


def test_nested_sparse_and_quantized_activations_need_a_transform(tmp_path: Path) -> None:
    """Shards store rows of one shape: a nested tensor of ragged rows (a transformer's fast
    path), a sparse or a quantized tensor is refused with the transform that stores it (it
    crashed inside torch before), and with that transform the rows are stored."""
    rows = [torch.randn(3, 4), torch.randn(2, 4)]
    nested = torch.nested.nested_tensor(rows)
    x = torch.randn(2, 4)
    cases = [
        (nested, "a nested tensor of ragged rows", "to_padded_tensor(0.0)"),
        (x.to_sparse(), "a sparse tensor (torch.sparse_coo)", "to_dense()"),
        (torch.quantize_per_tensor(x, 0.1, 0, torch.qint8), "a quantized tensor", "dequantize()"),
    ]
    for value, what, fix in cases:
        with (
            ShardWriter(tmp_path / "refused") as writer,
            pytest.raises(RecorderConfigError, match="ordinary dense tensor") as caught,
        ):
            writer.write("enc", "enc", value, sample_index=range(2))
        assert what in str(caught.value) and fix in str(caught.value)
    sources = {"padded": {"transform": lambda t: t.to_padded_tensor(0.0)}}
    with ShardWriter(tmp_path / "padded", sources=sources) as writer:
        writer.write("padded", "enc", nested, sample_index=range(2))
    stored = concat_activations(tmp_path / "padded", "padded")
    assert stored.shape == (2, 3, 4)
    assert torch.equal(stored[0], rows[0]) and torch.equal(stored[1, :2], rows[1])
    assert not stored[1, 2].any()  # the padding


def test_a_sequence_first_output_is_refused_with_advice_a_transform_cannot_break(
    tmp_path: Path,
) -> None:
    # nn.MultiheadAttention(batch_first=False) returns (L, N, E): 5 steps of 3 samples
    attention = nn.MultiheadAttention(4, 2)
    x = torch.randn(5, 3, 4)
    with torch.no_grad():
        output, _ = attention(x, x, x, need_weights=False)
    writer = ShardWriter(tmp_path, sources={"t": {"transform": lambda t: t.transpose(0, 1)}})
    with pytest.raises(
        RecorderConfigError,
        match=r"but got 5 rows \(shape \(5, 3, 4\)\); record an output with a row per sample "
        r"\(choose one with `path`, or record a module whose output is batch-first, such as an "
        r"RNN or attention layer built with batch_first=True: a `transform` keeps the rows it is "
        r"given\), or give sample indices that match its rows\.$",
    ):
        writer.write("a", "attn", output, sample_index=[0, 1, 2])
    with pytest.raises(RecorderConfigError, match=r"`transform` of source 't' .* with 5 rows"):
        writer.write("t", "attn", output, sample_index=[0, 1, 2])  # the rows are kept
    assert writer._thread is None  # nothing was queued
    writer.close()


def test_views_are_copied_so_the_queue_counts_what_it_holds(tmp_path: Path) -> None:
    big = torch.randn(64, 100)
    with ShardWriter(tmp_path, sources={"first": {"tokens": 0}}) as writer:
        writer.write("first", "m", big.view(64, 10, 10), sample_index=range(64))
        writer.write("row", "m", big[:2], sample_index=[0, 1])
    assert torch.equal(concat_activations(tmp_path, "first"), big.view(64, 10, 10)[:, 0])
    assert torch.equal(concat_activations(tmp_path, "row"), big[:2])


class _Blocked(ShardWriter):
    """A writer whose thread waits for a gate before writing each shard."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate, self.entered = threading.Event(), threading.Event()

    def _commit(self) -> None:
        self.entered.set()
        self.gate.wait(10)
        super()._commit()


@pytest.mark.parametrize("policy", ["drop", "raise"])
def test_full_queue_policies(tmp_path: Path, policy: str) -> None:
    writer = _Blocked(tmp_path, max_shard_bytes=1, max_queue_bytes=1000, queue_full=policy)
    try:
        batch = torch.zeros(10, 10)  # 400 bytes
        assert writer.write("s", "m", batch)  # taken by the thread, which then waits at the gate
        assert writer.entered.wait(10)  # the thread holds the first batch (400 bytes counted)
        assert writer.write("s", "m", batch)  # 800 bytes queued
        if policy == "drop":
            assert not writer.write("s", "m", batch)
            assert writer.dropped == 1
        else:
            with pytest.raises(RecorderStateError, match=r"queue of .* is full"):
                writer.write("s", "m", batch)
    finally:
        writer.gate.set()
        writer.close()
    assert len(ActivationDataset(tmp_path)) == 20  # the two batches the queue took


@pytest.mark.parametrize("policy", ["drop", "raise"])
def test_a_batch_larger_than_the_queue_and_flush_are_never_refused(
    tmp_path: Path, policy: str
) -> None:
    writer = _Blocked(tmp_path, max_shard_bytes=1, max_queue_bytes=1000, queue_full=policy)
    try:
        assert writer.write("s", "m", torch.zeros(10, 10))  # held by the thread at the gate
        assert writer.entered.wait(10)
        assert writer.write("s", "m", torch.zeros(50, 10))  # 2000 bytes, alone in the queue
        assert writer.queued_bytes == 2400
        errors: list[BaseException] = []

        def flush() -> None:
            try:
                writer.flush()  # the queue is over its limit: a flush still goes in
            except BaseException as err:
                errors.append(err)

        flushed = threading.Thread(target=flush)
        flushed.start()
        writer.gate.set()
        flushed.join(10)
        assert not flushed.is_alive() and not errors and writer.dropped == 0
    finally:
        writer.gate.set()
        writer.close()
    assert len(ActivationDataset(tmp_path)) == 60


def test_queue_waits_for_room_and_bounds_memory(tmp_path: Path) -> None:
    writer = _Blocked(tmp_path, max_shard_bytes=1, max_queue_bytes=1000, queue_full="wait")
    seen: list[int] = []
    producer = threading.Thread(
        target=lambda: [
            (writer.write("s", "m", torch.full((10, 10), float(i))), seen.append(i))
            for i in range(6)
        ]
    )
    producer.start()
    producer.join(0.5)
    assert producer.is_alive() and writer.queued_bytes <= 1000  # blocked: the queue is full
    writer.gate.set()
    producer.join(10)
    writer.close()
    assert seen == list(range(6))
    values = concat_activations(tmp_path, "s")
    assert values.shape == (60, 10) and writer.wait_seconds > 0


def test_crash_leaves_complete_shards_and_an_exact_index(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, run="crash", max_shard_bytes=1) as writer:
        for i in range(3):
            writer.write("s", "m", torch.full((2, 3), float(i)), batch_idx=i)
    # A crash while writing the fourth shard: its temporary file, and a third shard whose index
    # was never written.
    (tmp_path / "crash-rank00000-000003.safetensors.tmp").write_bytes(b"partial")
    (tmp_path / "crash-rank00000-000002.index.json").unlink()
    dataset = ActivationDataset(tmp_path)
    assert sorted({c["batch_idx"] for c in dataset.chunks}) == [0, 1]
    assert torch.equal(dataset.concat(), torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
    # The same run resumed cleans up what the crash left, then continues the numbering.
    resumed = ShardWriter(tmp_path, run="crash")
    resumed.discard_from(1)
    assert _files(tmp_path, ".tmp") == []
    assert _files(tmp_path, ".safetensors") == [
        "crash-rank00000-000000.safetensors",
        "crash-rank00000-000001.safetensors",
    ]
    with resumed:
        resumed.write("s", "m", torch.full((2, 3), 2.0), batch_idx=2)
    assert sorted({c["batch_idx"] for c in ActivationDataset(tmp_path).chunks}) == [0, 1, 2]


def test_generations_make_resume_free_of_duplicates(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, run="gen")
    writer.write("s", "m", torch.zeros(1, 2), global_step=0)
    saved = writer.checkpoint()  # what a checkpoint stores
    writer.write("s", "m", torch.ones(1, 2), global_step=1)  # written after the checkpoint
    writer.close()
    again = ShardWriter(tmp_path, run="gen")
    assert again.discard_from(saved) == 1
    with again:
        again.write("s", "m", torch.ones(1, 2), global_step=1)
    dataset = ActivationDataset(tmp_path)
    assert [row["global_step"] for row in dataset.provenance()] == [0, 1]


def test_a_dataset_opened_before_a_resume_never_reads_a_new_shard_as_a_removed_one(
    tmp_path: Path,
) -> None:
    writer = ShardWriter(tmp_path, run="gen", max_shard_bytes=1)
    writer.write("s", "m", torch.zeros(1, 2), global_step=0, sample_index=[0])
    saved = writer.checkpoint()
    writer.write("s", "m", torch.ones(1, 2), global_step=1, sample_index=[7])
    writer.close()
    before = ActivationDataset(tmp_path)  # listed both shards; reads none yet
    removed = _files(tmp_path, ".safetensors")[1]
    again = ShardWriter(tmp_path, run="gen")
    assert again.discard_from(saved) == 1
    with again:  # the resumed run writes step 1 again, other rows of the same shape
        again.write("s", "m", torch.full((1, 2), 5.0), global_step=1, sample_index=[3])
    assert removed not in _files(tmp_path, ".safetensors")  # a new name for the new shard
    assert torch.equal(before[0]["activation"], torch.zeros(2))
    with pytest.raises(RecorderConfigError, match=rf"{removed} to be a complete activation"):
        before[1]  # sample 7's row is gone: never sample 3's row in its place
    after = ActivationDataset(tmp_path)
    assert [(r["sample_index"], r["global_step"]) for r in after.provenance()] == [(0, 0), (3, 1)]
    assert torch.equal(after.concat(), torch.tensor([[0.0, 0.0], [5.0, 5.0]]))


def test_fsspec_memory_filesystem(tmp_path: Path) -> None:
    url = f"memory://{tmp_path.name}/acts"
    x = torch.randn(5, 3)
    with ShardWriter(url, max_shard_bytes=1) as writer:
        for i in range(5):
            writer.write("s", "m", x[i : i + 1], sample_index=[i])
    assert writer.shards_written == 5
    assert torch.equal(concat_activations(url, "s"), x)


def test_one_tensor_written_twice_in_a_shard(tmp_path: Path) -> None:
    # two sources of one output hand the writer the same tensor: safetensors refuses tensors
    # that share memory, so the writer stores a copy of the second
    x = torch.randn(3, 4)
    for url in (tmp_path / "local", f"memory://{tmp_path.name}/twice"):
        with ShardWriter(url) as writer:
            writer.write("a", "m", x, sample_index=range(3))
            writer.write("b", "m", x, sample_index=range(3))
        assert writer.shards_written == 1
        assert torch.equal(concat_activations(url, "a"), x)
        assert torch.equal(concat_activations(url, "b"), x)


def test_thread_error_reaches_the_caller(tmp_path: Path) -> None:
    class Failing(ShardWriter):
        def _commit(self) -> None:
            raise OSError("No space left on device")

    writer = Failing(tmp_path, max_shard_bytes=1)
    writer.write("s", "m", torch.zeros(2))
    with pytest.raises(RecorderStateError, match=r"failed to write a shard: No space left"):
        writer.close()
    assert writer._thread is not None and not writer._thread.is_alive()


def test_a_write_that_fails_leaves_no_part_of_its_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The index file cannot take its place (a folder of its name): the shard it would list goes
    # too, with the index's temporary file.
    blocked = tmp_path / "blocked"
    writer = ShardWriter(blocked, run="idx", max_shard_bytes=1)
    writer.write("s", "m", torch.zeros(2, 3), batch_idx=0)
    writer.flush()
    (blocked / "idx-rank00000-000001.index.json").mkdir()
    writer.write("s", "m", torch.ones(2, 3), batch_idx=1)
    with pytest.raises(RecorderStateError, match="failed to write a shard"):
        writer.close()
    assert sorted(p.name for p in blocked.iterdir()) == [
        "idx-rank00000-000000.index.json",
        "idx-rank00000-000000.safetensors",
        "idx-rank00000-000001.index.json",  # the folder in the way
    ]

    # The disk fills up while a shard is written: its temporary file goes.
    def full_disk(tensors: dict[str, torch.Tensor], filename: str, **kwargs: object) -> None:
        Path(filename).write_bytes(b"\0" * 64)  # a part written, then the disk is full
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    full = tmp_path / "full"
    writer = ShardWriter(full, run="full", max_shard_bytes=1)
    writer.write("s", "m", torch.zeros(2, 3))
    with pytest.raises(RecorderStateError, match="No space left on device"):
        writer.close()
    assert list(full.iterdir()) == []


def test_bad_arguments(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RecorderConfigError, match=r"to be a writable directory"):
        ShardWriter(blocker / "sub")
    with pytest.raises(RecorderConfigError, match=r"Expected `queue_full` .* but got 'block'"):
        ShardWriter(tmp_path, queue_full="block")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `max_queue_bytes` .* got 0"):
        ShardWriter(tmp_path, max_queue_bytes=0)
    with pytest.raises(RecorderConfigError, match=r"Expected `run` .* got 'a/b'"):
        ShardWriter(tmp_path, run="a/b")
    with pytest.raises(RecorderConfigError, match=r"among tokens, mean, transform, dtype"):
        ShardWriter(tmp_path, sources={"s": {"average": 1}})
    with pytest.raises(RecorderConfigError, match=r"other than 0"):
        ShardWriter(tmp_path, sources={"s": {"mean": [0, 1]}})
    with pytest.raises(RecorderConfigError, match=r"Expected `dtype` .* got 'half_float'"):
        ShardWriter(tmp_path, sources={"s": {"dtype": "half_float"}})
    # a dtype the shards cannot hold is refused here, not when the first batch is cast to it
    for dtype in ("complex64", torch.quint8, "float8_e4m3fn"):
        with pytest.raises(
            RecorderConfigError,
            match=r"Expected `dtype` of source 's' to be a dtype the shard format stores "
            r"\(bfloat16, bool, .*\) but got torch\.(complex64|quint8|float8_e4m3fn)\.$",
        ):
            ShardWriter(tmp_path, sources={"s": {"dtype": dtype}})
    assert _files(tmp_path, "") == ["file"]  # nothing left behind
    writer = ShardWriter(tmp_path, sources={"s": {"transform": lambda t: t.sum()}})
    with pytest.raises(
        RecorderConfigError,
        match=r"as many as the sample indices \(3: .* but got 2 rows \(shape \(2, 2\)\)",
    ):
        writer.write("x", "m", torch.zeros(2, 2), sample_index=[0, 1, 2])
    with pytest.raises(RecorderConfigError, match=r"\(2: .* but got a 0-d tensor \(one value\)"):
        writer.write("x", "m", torch.tensor(1.0), sample_index=[0, 1])
    with pytest.raises(RecorderConfigError, match=r"return a tensor with 2 rows"):
        writer.write("s", "m", torch.zeros(2, 2))
    with pytest.raises(RecorderConfigError, match=r"dtype the shard format stores"):
        writer.write("x", "m", torch.zeros(2, dtype=torch.float8_e4m3fn))
    # a cast of complex values to a real dtype drops their imaginary part: not the advice
    with pytest.raises(
        RecorderConfigError,
        match=r"but got torch\.complex64; store their real and imaginary parts with the option "
        r"`transform` torch\.view_as_real \(a last dimension of 2\), or their magnitude with "
        r"torch\.abs \(a cast with `dtype` would drop the imaginary part\)\.$",
    ):
        writer.write("x", "m", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(RecorderConfigError, match=r"to be a tensor but got tuple"):
        writer.write("x", "m", (torch.zeros(2),))  # type: ignore[arg-type]
    assert writer._thread is None  # nothing was queued: no thread started
    writer.close()
    with pytest.raises(RecorderStateError, match=r"is closed"):
        writer.write("x", "m", torch.zeros(2))


def test_provenance_of_another_type_is_refused_when_written(tmp_path: Path) -> None:
    # a stage of 3 was written and the dataset failed to open (TypeError sorting the rows), a
    # global_step of 1.5 was stored as 1, an epoch of None failed inside int()
    writer = ShardWriter(tmp_path, run="r")
    for option, value, kind in (
        ("stage", 3, "a str"),
        ("global_step", 1.5, "an int"),
        ("epoch", None, "an int"),
        ("batch_idx", "1", "an int"),
        ("dataloader_idx", True, "an int"),
        ("call", 0.0, "an int"),
    ):
        with pytest.raises(
            RecorderConfigError, match=rf"Expected `{option}` to be {kind}.* but got .*{value!r}"
        ):
            writer.write("x", "m", torch.zeros(2), **{option: value})
    with pytest.raises(RecorderConfigError, match=r"Expected `stage` to be a str"):
        writer.write_records(RecorderManager(), stage=None)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `source` to be a str but got int 1"):
        writer.write(1, "m", torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `module` to be a str but got None"):
        writer.write("x", None, torch.zeros(2))  # type: ignore[arg-type]
    # integers of NumPy and integer 0-d tensors are ints
    writer.write("x", "m", torch.zeros(2), global_step=np.int64(3), epoch=torch.tensor(2))
    writer.close()
    (row,) = ActivationDataset(tmp_path).provenance()[:1]
    assert (row["stage"], row["global_step"], row["epoch"]) == ("predict", 3, 2)


def test_write_checks_its_arguments_before_anything_is_written(tmp_path: Path) -> None:
    # a stage no filter names ("validate"), a negative step or call, and 2-d sample indices
    # ((2, 2) for 4 rows, flattened into the rows' indices) were written without a word
    writer = ShardWriter(tmp_path, run="r", max_shard_bytes=1)  # each write would be a shard
    x = torch.zeros(4, 2)
    stages = r"to be one of 'train', 'val', 'test', 'predict' \(.*\) but got"
    for kwargs, match in (
        ({"stage": "validate"}, stages + r" 'validate'\. Closest stages: 'val'\.$"),
        ({"stage": "Train"}, stages + r" 'Train'\. Closest stages: 'train'\.$"),
        ({"stage": "fit"}, stages + r" 'fit'\.$"),  # no close match: the list alone
        ({"global_step": -1}, r"`global_step` to be an int >= 0 but got -1: it counts the opt"),
        ({"global_step": True}, r"`global_step` to be an int >= 0 but got bool True\.$"),
        ({"call": -1}, r"`call` to be an int >= 0 but got -1: it numbers the calls"),
        ({"call": np.int64(-2)}, r"`call` to be an int >= 0 but got -2"),
        ({"call": False}, r"`call` to be an int >= 0 but got bool False\.$"),
        ({"epoch": -1}, r"`epoch` to be an int >= 0 but got -1: it counts the epochs from 0"),
        ({"batch_idx": -1}, r"`batch_idx` to be an int >= 0 but got -1: it numbers the batch"),
        ({"dataloader_idx": -1}, r"`dataloader_idx` to be an int >= 0 but got -1: it numbers"),
        (
            {"sample_index": torch.arange(4).view(2, 2)},
            r"`sample_index`\) to be 1-d, of shape \(N,\) with N the batch's first dimension "
            r"\(N = 4 here: one dataset index per row; \(N, 1\) is taken too, .*\), but got "
            r"shape \(2, 2\); pass one index per row\.$",
        ),
        ({"sample_index": np.arange(4).reshape(2, 2)}, r"\(N = 4 here.* got shape \(2, 2\);"),
        ({"sample_index": torch.arange(4).view(1, 4, 1)}, r"got shape \(1, 4, 1\);"),
        ({"sample_index": torch.tensor(0)}, r"\(N = 4 here.* got shape \(\) \(one value\);"),
        ({"sample_index": [[0], [1], [2], [3]]}, r"1-d, .* got a sequence holding list \[0\];"),
        ({"sample_index": [torch.tensor([i]) for i in range(4)]}, r"holding Tensor tensor\(\["),
        ({"sample_index": torch.arange(4.0)}, r"integer dataset indices but got a tensor of"),
        ({"sample_index": [0, 1, 2]}, r"as many as the sample indices \(3: "),
    ):
        with pytest.raises(RecorderConfigError, match=match):
            writer.write("x", "m", x, **kwargs)  # type: ignore[arg-type]
    manager = RecorderManager({"hidden": {"type": "ModuleOutputs", "source": "0"}})
    model = nn.Sequential(nn.Linear(2, 3))
    manager.initialize(model)
    with manager:
        model(x)
    for kwargs, match in (
        ({"stage": "validate"}, r"Closest stages: 'val'"),
        ({"global_step": -3}, r"`global_step` to be an int >= 0 but got -3"),
        ({"sample_index": torch.arange(4).view(1, 4)}, r"\(N: one .* but got shape \(1, 4\)"),
    ):
        with pytest.raises(RecorderConfigError, match=match):
            writer.write_records(manager, **kwargs)  # type: ignore[arg-type]
    manager.release()
    # nothing half-done: no thread, no shard, no temporary file, no row counted
    assert writer._thread is None and writer.queued_bytes == 0
    assert list(tmp_path.iterdir()) == []
    assert (writer.rows_written, writer.shards_written, writer.dropped) == (0, 0, 0)
    # every stage, a step and call of 0, 1-d indices of any integer dtype are written
    for number, stage in enumerate(("train", "val", "test", "predict")):
        writer.write("x", "m", x + number, stage=stage, sample_index=torch.arange(4).int())
    writer.write("x", "m", x, global_step=np.int64(0), call=torch.tensor(0), sample_index=range(4))
    # (N, 1), as a dataset returning torch.tensor([index]) collates its indices: one per row
    writer.write("x", "m", x, stage="test", global_step=7, sample_index=torch.arange(4).view(4, 1))
    writer.write("x", "m", x, stage="test", global_step=8, sample_index=np.arange(4)[:, None])
    writer.close()
    assert writer.rows_written == 28
    data = ActivationDataset(tmp_path, stages="val")
    assert data.sample_indices.tolist() == [0, 1, 2, 3]
    for step in (7, 8):
        assert ActivationDataset(tmp_path, steps=step).sample_indices.tolist() == [0, 1, 2, 3]
    assert torch.equal(data.concat(), x + 1)  # exact: zeros plus an integer, no rounding


def test_write_records_refuses_names_it_would_match_nothing_with(tmp_path: Path) -> None:
    # a str (iterated letter by letter) or a misspelt name wrote nothing and returned 0; an int
    # failed with a TypeError, a model instead of the manager with an AttributeError
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    manager = RecorderManager({"hidden": {"type": "ModuleOutputs", "source": "1"}})
    manager.initialize(model)
    with manager:
        model(torch.randn(3, 6))
    writer = ShardWriter(tmp_path, run="r")
    with pytest.raises(RecorderConfigError, match=r"got str 'hidden'; pass \['hidden'\] for one"):
        writer.write_records(manager, names="hidden")
    with pytest.raises(RecorderConfigError, match=r"or None but got int 5\.$"):
        writer.write_records(manager, names=5)  # type: ignore[arg-type]
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected `names` to be among the manager's recorders \['hidden'\] but got "
        r"\['hiden'\]\.$",
    ):
        writer.write_records(manager, names=["hiden"])
    with pytest.raises(RecorderConfigError, match=r"a RecorderManager .* but got Sequential"):
        writer.write_records(model)  # type: ignore[arg-type]
    assert writer.write_records(manager, names=[]) == 0
    assert writer.write_records(manager, names=("hidden",)) == 1
    writer.close()
    manager.release()
    assert concat_activations(tmp_path, "hidden").shape == (3, 8)


def test_dataset_filters_and_errors(tmp_path: Path) -> None:
    with pytest.raises(RecorderConfigError, match=r"has none"):
        ActivationDataset(tmp_path)
    for rank in (0, 1):
        with ShardWriter(tmp_path, run="f", rank=rank) as writer:
            for step in (0, 1):
                writer.write(
                    "a",
                    "m1",
                    torch.full((2, 2), 10.0 * rank + step),
                    stage="train",
                    global_step=step,
                    sample_index=[0, 1],
                )
                writer.write("b", "m2", torch.zeros(2, 3), stage="val", global_step=step)
    assert len(ActivationDataset(tmp_path)) == 16
    only = ActivationDataset(tmp_path, "a", steps=1, ranks=[1])
    assert len(only) == 2 and torch.equal(only.concat(), torch.full((2, 2), 11.0))
    # numbers given as strings (a RANK read from the environment) matched no row: refused
    for filters in ({"ranks": "1"}, {"steps": ["0", "1"]}, {"epochs": [0.5]}, {"ranks": [True]}):
        with pytest.raises(RecorderConfigError, match=r"to be an int or a list of ints but got"):
            ActivationDataset(tmp_path, **filters)
    assert len(ActivationDataset(tmp_path, ranks=np.int64(1))) == 8  # numpy integers are ints
    assert len(ActivationDataset(tmp_path, stages="val", modules="m2")) == 8
    with pytest.raises(RecorderConfigError, match=r"`sources` .* \['a', 'b'\] but got \['c'\]"):
        ActivationDataset(tmp_path, "c")
    with pytest.raises(RecorderConfigError, match=r"choose one of"):
        ActivationDataset(tmp_path).concat()
    with pytest.raises(RecorderConfigError, match=r"share one shape"):
        _mixed_shapes(tmp_path)
    with pytest.raises(RecorderConfigError, match=r"Expected filters among"):
        concat_activations(tmp_path, "a", step=1)


def test_a_filter_naming_no_row_is_refused_with_the_values_there(tmp_path: Path) -> None:
    for rank in (0, 1):
        with ShardWriter(tmp_path, run="r1", rank=rank) as writer:
            writer.write("a", "m", torch.zeros(2, 2), stage="train", global_step=3, epoch=1)
    # each value of the directory keeps rows; one of several unknown values is allowed
    assert len(ActivationDataset(tmp_path, runs="r1", steps=[3, 4], epochs=1, ranks=1)) == 2
    # a misspelt name: its close match first, then every value there
    match = (
        r"`runs` of ActivationDataset to name some of the runs written but got \['r2'\]\. "
        r"Closest runs: 'r1'\. All runs written: \['r1'\]\.$"
    )
    with pytest.raises(RecorderConfigError, match=match):
        ActivationDataset(tmp_path, runs="r2")
    with pytest.raises(RecorderConfigError, match=match):
        concat_activations(tmp_path, "a", runs="r2")
    for key, wrong, have in (
        ("runs", "other", "['r1']"),
        ("steps", 4, "[3]"),
        ("epochs", [0, 2], "[1]"),
        ("ranks", 2, "[0, 1]"),
        ("calls", 1, "[0]"),
    ):
        match = rf"`{key}` of ActivationDataset to name some of {re.escape(have)} but got"
        with pytest.raises(RecorderConfigError, match=match):
            ActivationDataset(tmp_path, **{key: wrong})
        with pytest.raises(RecorderConfigError, match=match):
            concat_activations(tmp_path, "a", **{key: wrong})


def test_a_misspelt_source_or_dtype_names_the_close_match_first(tmp_path: Path) -> None:
    # the filter listed every source written and the option gave one example, with no close
    # match: among many module names a near-miss was left to the reader to spot
    with ShardWriter(tmp_path, run="r") as writer:
        writer.write("net.0.output", "net.0", torch.zeros(2, 2), stage="train")
        writer.write("net.2.output", "net.2", torch.zeros(2, 2), stage="val")
    every = r"\['net\.0\.output', 'net\.2\.output'\]"
    with pytest.raises(
        RecorderConfigError,
        match=r"^Expected `sources` of ActivationDataset to name some of the sources written but "
        r"got \['net\.0\.ouput'\]\. Closest sources: 'net\.0\.output'(, 'net\.2\.output')?\. "
        rf"All sources written: {every}\.$",
    ):
        ActivationDataset(tmp_path, "net.0.ouput")
    with pytest.raises(RecorderConfigError, match=r"Closest stages: 'val'\. All stages written"):
        concat_activations(tmp_path, stages="valid")
    # no close match: the list alone, as before
    with pytest.raises(RecorderConfigError, match=rf"name some of {every} but got \['zz'\]\.$"):
        ActivationDataset(tmp_path, "zz")
    stored = r"The shard format stores bfloat16, bool, float16, float32, .*, uint8\.$"
    with pytest.raises(
        RecorderConfigError,
        match=r"^Expected `dtype` of source 's' to be a torch\.dtype or its name \(e\.g\. "
        rf"'float16'\) but got 'float23'\. Closest dtype names: 'float32'.*\. {stored}",
    ):
        ShardWriter(tmp_path, sources={"s": {"dtype": "float23"}})
    with pytest.raises(RecorderConfigError, match=rf"but got 'xyz'\. {stored}"):
        ShardWriter(tmp_path, sources={"s": {"dtype": "xyz"}})
    assert len(ActivationDataset(tmp_path, "net.0.output")) == 2
    # concat's own source argument: sources and modules, the close one named
    with pytest.raises(
        RecorderConfigError,
        match=r"or modules \['net\.0', 'net\.2'\] but got 'net\.0\.ouptut'\. Closest sources and "
        r"modules: 'net\.0\.output'",
    ):
        ActivationDataset(tmp_path).concat("net.0.ouptut")


def test_filters_that_each_keep_rows_but_none_together_are_refused(tmp_path: Path) -> None:
    with ShardWriter(tmp_path) as writer:
        writer.write("a", "m1", torch.zeros(2, 2), stage="train")
        writer.write("b", "m2", torch.zeros(2, 3), stage="val")
    match = (
        r"together to keep some rows but no row matches them all: `stages` \['val'\] where "
        r"the other filters keep \['train'\]; `sources` \['a'\] where the other filters keep "
        r"\['b'\]"
    )
    with pytest.raises(RecorderConfigError, match=match):
        ActivationDataset(tmp_path, "a", stages="val")
    with pytest.raises(RecorderConfigError, match=match):
        concat_activations(tmp_path, "a", sources="a", stages="val")
    assert len(ActivationDataset(tmp_path, "a", stages="train")) == 2
    assert len(ActivationDataset(tmp_path, steps=[])) == 0  # an empty list keeps no row


def test_provenance_is_every_item_without_its_activation(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    manager = RecorderManager({"lin": {"type": "ModuleOutputs", "source": "0", "detach": True}})
    manager.initialize(model)
    x = torch.randn(2, 3)
    try:
        with ShardWriter(tmp_path) as writer, torch.no_grad():
            with manager:
                model[0](model[0](x))  # called twice in one forward: calls 0 and 1
            writer.write_records(manager, dataloader_idx=1, sample_index=[5, 6])
    finally:
        manager.release()
    dataset = ActivationDataset(tmp_path)
    rows = dataset.provenance()
    assert [(r["sample_index"], r["call"], r["dataloader_idx"]) for r in rows] == [
        (5, 0, 1),
        (5, 1, 1),
        (6, 0, 1),
        (6, 1, 1),
    ]
    for i, row in enumerate(rows):
        item = dataset[i]
        assert row == {**{k: v for k, v in item.items() if k != "activation"}, "shape": [3]}


def test_calls_filter_keeps_one_call_of_a_module_called_twice(tmp_path: Path) -> None:
    model = _net()[:1]
    manager = RecorderManager({"lin": {"type": "ModuleOutputs", "source": "0", "detach": True}})
    manager.initialize(model)
    x = torch.randn(4, 6)
    inner = nn.Linear(8, 6)
    try:
        with ShardWriter(tmp_path) as writer, torch.no_grad():
            with manager:
                first = model[0](x)
                second = model[0](inner(first))  # the same layer again: call 1
            writer.write_records(manager, sample_index=[0, 1, 2, 3])
    finally:
        manager.release()
    assert len(ActivationDataset(tmp_path)) == 8  # both calls
    for call, expected in ((0, first), (1, second)):
        dataset = ActivationDataset(tmp_path, "lin", calls=call)
        assert len(dataset) == 4 and {r["call"] for r in dataset.provenance()} == {call}
        assert torch.equal(dataset.concat(), expected)  # the stored bytes of that call
        assert torch.equal(concat_activations(tmp_path, "lin", calls=[call]), expected)
    assert len(ActivationDataset(tmp_path, calls=[0, 1])) == 8
    with pytest.raises(RecorderConfigError, match=r"`calls` to be an int or a list of ints"):
        ActivationDataset(tmp_path, calls="0")


def test_dataloaders_filter_keeps_one_dataloader_of_a_stage(tmp_path: Path) -> None:
    first, second = torch.randn(3, 2), torch.randn(2, 2)
    with ShardWriter(tmp_path) as writer:  # two predict dataloaders, each indexed from 0
        writer.write("s", "m", first, dataloader_idx=0, sample_index=[0, 1, 2])
        writer.write("s", "m", second, dataloader_idx=1, sample_index=[0, 1])
    assert len(ActivationDataset(tmp_path)) == 5  # interleaved by sample index
    for idx, expected in ((0, first), (1, second)):
        dataset = ActivationDataset(tmp_path, dataloaders=idx)
        assert dataset.sample_indices.tolist() == list(range(len(expected)))
        assert {r["dataloader_idx"] for r in dataset.provenance()} == {idx}
        assert torch.equal(dataset.concat(), expected)
        assert torch.equal(concat_activations(tmp_path, "s", dataloaders=[idx]), expected)
    with pytest.raises(RecorderConfigError, match=r"`dataloaders` .* name some of \[0, 1\]"):
        ActivationDataset(tmp_path, dataloaders=2)


def _four_shards(directory: Path) -> list[str]:
    """Four shards of one row pair each; their names, in order."""
    with ShardWriter(directory, run="d", max_shard_bytes=1) as writer:
        for step in range(4):
            writer.write("h", "m", torch.full((2, 4), float(step)), stage="predict")
    return _files(directory, ".safetensors")


def test_missing_truncated_or_damaged_files_fail_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    shards = _four_shards(missing)
    assert len(shards) == 4 and len(ActivationDataset(missing)) == 8
    os.remove(missing / shards[1])
    for read in (lambda: ActivationDataset(missing), lambda: concat_activations(missing, "h")):
        with pytest.raises(RecorderConfigError, match=rf"missing \(1\): {shards[1]}\. Restore"):
            read()

    truncated = tmp_path / "truncated"
    shards = _four_shards(truncated)
    os.truncate(truncated / shards[2], 30)
    dataset = ActivationDataset(truncated)  # the index files are intact: rows are listed
    assert torch.equal(dataset[0]["activation"], torch.zeros(4))
    with pytest.raises(RecorderConfigError, match=rf"{shards[2]} to be a complete activation"):
        dataset[4]

    damaged = tmp_path / "damaged"
    _four_shards(damaged)
    index = _files(damaged, ".index.json")[3]
    (damaged / index).write_text("{not json")
    with pytest.raises(RecorderConfigError, match=rf"Expected {index} to be an activation index"):
        ActivationDataset(damaged)

    # a shard swapped for another one's (same name, other tensors): the row names the file
    swapped = tmp_path / "swapped"
    shards = _four_shards(swapped)
    other = tmp_path / "other"
    with ShardWriter(other, run="o") as writer:
        writer.write("x", "m", torch.zeros(2, 4))
    os.replace(other / _files(other, ".safetensors")[0], swapped / shards[1])
    with pytest.raises(RecorderConfigError, match=rf"{shards[1]} to hold the tensor 'h/m/0'"):
        ActivationDataset(swapped)[2]

    # a file given for the directory (one of its shards)
    shard = tmp_path / "given" / _four_shards(tmp_path / "given")[0]
    for read in (lambda: ActivationDataset(shard), lambda: concat_activations(shard, "h")):
        with pytest.raises(RecorderConfigError, match=r"to be a directory of .* but it is a file"):
            read()


def test_shards_removed_while_a_dataset_opens_are_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = _four_shards(tmp_path)
    indexes = _files(tmp_path, ".index.json")
    read = Storage.read

    def racing(self: Storage, name: str) -> bytes:
        if name == indexes[2]:  # meanwhile a resumed run removes shards 1 (read) and 2 (listed)
            for i in (1, 2):
                os.remove(tmp_path / indexes[i])  # the index file first, as the writer does
                os.remove(tmp_path / shards[i])
        return read(self, name)

    monkeypatch.setattr(Storage, "read", racing)
    dataset = ActivationDataset(tmp_path)
    assert torch.equal(dataset.concat(), torch.tensor([0.0, 0.0, 3.0, 3.0])[:, None].expand(4, 4))


def _mixed_shapes(tmp_path: Path) -> None:
    directory = tmp_path / "mixed"
    with ShardWriter(directory) as writer:
        writer.write("s", "m", torch.zeros(1, 2))
        writer.write("s", "m", torch.zeros(1, 3))
    ActivationDataset(directory).concat("s")


def test_dataset_in_a_dataloader(tmp_path: Path) -> None:
    x = torch.randn(10, 4)
    with ShardWriter(tmp_path, max_shard_bytes=40) as writer:
        for i in range(0, 10, 2):
            writer.write("s", "m", x[i : i + 2].clone(), sample_index=[i, i + 1])
    dataset = ActivationDataset(tmp_path)
    assert torch.equal(dataset[3]["activation"], x[3])  # opens (maps) a shard
    copy = pickle.loads(pickle.dumps(dataset))  # as DataLoader workers started by spawn get it
    assert torch.equal(copy[9]["activation"], x[9])
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    batches = list(loader)
    assert torch.equal(torch.cat([b["activation"] for b in batches]), x)
    assert torch.cat([b["sample_index"] for b in batches]).tolist() == list(range(10))


def test_a_row_index_that_is_not_an_int_is_refused_naming_the_ways_to_take_rows(
    tmp_path: Path,
) -> None:
    x = torch.arange(8.0).view(4, 2)
    with ShardWriter(tmp_path) as writer:
        writer.write("s", "m", x, sample_index=range(4))
    dataset = ActivationDataset(tmp_path)
    for idx in (-1, np.int64(-4), torch.tensor(2)):  # integers, negative ones from the end
        assert torch.equal(dataset[idx]["activation"], x[int(idx)])
    for idx in (slice(0, 2), [0, 1], np.array([0, 1]), 1.0, True, torch.tensor(1.0)):
        with pytest.raises(RecorderConfigError, match=r"to be an int .*Subset.*concat"):
            dataset[idx]


def test_a_row_index_out_of_range_names_the_range_of_both_signs(tmp_path: Path) -> None:
    with ShardWriter(tmp_path) as writer:
        writer.write("s", "m", torch.zeros(4, 2), sample_index=range(4))
    dataset = ActivationDataset(tmp_path)
    assert dataset[-4]["sample_index"] == 0
    for idx in (4, -5):
        with pytest.raises(NoRecordError, match=r"index in \[-4, 4\) \(a negative one counts"):
            dataset[idx]
    assert len(list(dataset)) == 4  # iteration stops at the IndexError


@pytest.mark.parametrize("where", ["local", "memory"])
def test_writing_to_an_item_changes_no_later_read(tmp_path: Path, where: str) -> None:
    directory = str(tmp_path) if where == "local" else f"memory://{tmp_path.name}-items"
    x = torch.arange(8.0).view(4, 2)
    with ShardWriter(directory) as writer:
        writer.write("s", "m", x, sample_index=range(4))
    dataset = ActivationDataset(directory)
    dataset[1]["activation"].sub_(100.0)  # an in-place normalisation of one epoch
    dataset.concat()[2] = -1.0
    for i in range(4):  # the next epoch reads the rows as written
        assert torch.equal(dataset[i]["activation"], x[i])
    assert torch.equal(dataset.concat(), x)
    assert torch.equal(ActivationDataset(directory).concat(), x)  # nor was the file changed


def _write_then_die(directory: str) -> None:
    writer = ShardWriter(directory, run="kill", max_shard_bytes=4000)
    for i in range(40):
        writer.write("s", "m", torch.full((10, 100), float(i)), batch_idx=i)
        if i == 12:
            writer.flush()  # the shards of batches 0-12 are surely complete
        if i == 25:
            os._exit(3)  # no flush, no close: the process dies with the thread mid-work


def test_killed_process_leaves_only_complete_shards_listed(tmp_path: Path) -> None:
    safe_open = pytest.importorskip("safetensors").safe_open  # the reference reader
    process = multiprocessing.get_context("fork").Process(
        target=_write_then_die, args=(str(tmp_path),)
    )
    process.start()
    process.join(60)
    assert process.exitcode == 3
    for index in tmp_path.glob("*.index.json"):  # every listed shard opens and is complete
        entry = json.loads(index.read_text())
        with safe_open(str(tmp_path / entry["shard"]), framework="pt") as handle:
            assert sorted(handle.keys()) == sorted(c["key"] for c in entry["chunks"])
    dataset = ActivationDataset(tmp_path)
    batches = sorted({c["batch_idx"] for c in dataset.chunks})
    assert batches == list(range(len(batches))) and 13 <= len(batches) <= 26
    for chunk in dataset.chunks:
        expected = torch.full((10, 100), float(chunk["batch_idx"]))
        assert torch.equal(dataset._chunk_tensor(chunk), expected)


def test_every_dtype_reads_back_with_the_reference_reader(tmp_path: Path) -> None:
    load_file = pytest.importorskip("safetensors.torch").load_file  # the reference reader

    g = torch.Generator().manual_seed(0)
    values = {
        "bool": torch.rand(3, 5, generator=g) > 0.5,
        "uint8": torch.randint(0, 255, (3, 7), generator=g, dtype=torch.uint8),
        "int8": torch.randint(-128, 127, (3, 1), generator=g, dtype=torch.int8),
        "int16": torch.randint(-999, 999, (3, 2, 3), generator=g, dtype=torch.int16),
        "int32": torch.randint(-999, 999, (3,), generator=g, dtype=torch.int32),
        "int64": torch.randint(-999, 999, (3, 3), generator=g),
        "float16": torch.randn(3, 5, generator=g).half(),
        "bfloat16": torch.randn(3, 3, generator=g).bfloat16(),
        "float32": torch.randn(3, 0, generator=g),  # empty rows
        "float64": torch.randn(3, 4, generator=g, dtype=torch.float64),
    }
    with ShardWriter(tmp_path, run="dtypes") as writer:
        for name, tensor in values.items():
            writer.write(name, "m", tensor, sample_index=[0, 1, 2])
    (shard,) = tmp_path.glob("*.safetensors")
    loaded = load_file(str(shard))  # safetensors validates the header, offsets and size
    dataset = ActivationDataset(tmp_path)
    for chunk in dataset.chunks:
        expected = values[chunk["source"]]
        assert torch.equal(loaded[chunk["key"]], expected), chunk["key"]
        assert torch.equal(dataset._chunk_tensor(chunk), expected)  # our memory-mapped view
        assert dataset._chunk_tensor(chunk).dtype == expected.dtype


def test_batches_wait_in_the_queue_until_a_shard_is_full_then_are_all_written(
    tmp_path: Path,
) -> None:
    one = torch.ones(4, 25)  # 400 bytes
    with ShardWriter(tmp_path, run="lazy", max_shard_bytes=2000, max_queue_bytes=1 << 20) as w:
        for i in range(4):  # 1600 bytes: less than a shard, the thread is not needed yet
            w.write("s", "m", one * i, batch_idx=i)
        for i in range(4, 12):  # 4800 bytes: two shards complete, the rest stays pending
            w.write("s", "m", one * i, batch_idx=i)
        w.flush()
        assert w.queued_bytes == 0 and w.shards_written == 3
    dataset = ActivationDataset(tmp_path)
    assert torch.equal(dataset.concat("s")[::4, 0], torch.arange(12.0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux-only")
@pytest.mark.parametrize("low", [True, False])
def test_low_priority_lowers_only_the_writing_thread(tmp_path: Path, low: bool) -> None:
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ShardWriter(tmp_path, run="nice", low_priority=low) as writer:
        writer.write("s", "m", torch.ones(2, 2))
        writer.flush()  # the thread has started and handled an item
        thread = writer._thread
        assert thread is not None and thread.native_id is not None
        nice = os.getpriority(os.PRIO_PROCESS, thread.native_id)
    assert nice == (min(before + 10, 19) if low else before)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_low_priority_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(RecorderConfigError, match=r"Expected `low_priority` of ShardWriter"):
        ShardWriter(tmp_path, low_priority=1)  # type: ignore[arg-type]


def _kept_files(directory: Path) -> dict[str, tuple[int, int]]:
    """The inode and modification time of each shard and index file (a file replaced by a
    rename has another inode)."""
    return {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in directory.iterdir()
        if p.name.endswith((".safetensors", ".index.json"))
    }


def _assert_every_row_of_both(directory: Path, batches: int) -> None:
    dataset = ActivationDataset(directory)
    assert len(_files(directory, ".index.json")) == batches  # a shard per batch
    assert sorted(dataset.sample_indices) == list(range(2 * batches))
    for item in dataset:  # row of sample j holds j // 2 (small integers: compared exactly)
        assert torch.equal(item["activation"], torch.full((3,), float(item["sample_index"] // 2)))


_TWIN = r"taken by another writer, which is writing the same run 'twin' and rank 0"


@pytest.mark.parametrize("hard_links", [True, False])
def test_two_writers_of_one_run_and_rank_keep_each_others_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    # Two writers given the same run and rank write into one directory by turns, a shard per
    # batch: each numbers its shards from the names there at its first commit, and then finds
    # its next numbers taken by the other. None replaces a file of the other.
    if not hard_links:  # a filesystem without them (FAT, some network shares)

        def no_link(src: object, dst: object) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    writers = [ShardWriter(tmp_path, run="twin", max_shard_bytes=1) for _ in range(2)]
    kept: dict[str, tuple[int, int]] = {}
    with pytest.warns(UserWarning, match=_TWIN) as caught:
        for i in range(8):
            writer = writers[i % 2]
            writer.write("s", "m", torch.full((2, 3), float(i)), sample_index=[2 * i, 2 * i + 1])
            writer.flush()
            files = _kept_files(tmp_path)
            assert {name: files.get(name) for name in kept} == kept  # none replaced
            kept = files
        for writer in writers:
            writer.close()
    twins = [str(w.message) for w in caught if "another writer" in str(w.message)]
    assert len(twins) == 2  # once per writer, though both found numbers taken three times
    assert all("Give each writer its own `run`" in message for message in twins)
    assert [w.shards_written for w in writers] == [4, 4]
    _assert_every_row_of_both(tmp_path, 8)


@pytest.mark.slow
def test_two_processes_of_one_run_and_rank_keep_each_others_shards(tmp_path: Path) -> None:
    from helpers.shard_writer_twin import TIMEOUT, write_in_turns

    turns = 6
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(3), context.Queue()
    processes = [
        context.Process(target=write_in_turns, args=(str(tmp_path), role, turns, barrier, queue))
        for role in (0, 1)
    ]
    for process in processes:
        process.start()
    try:
        kept: dict[str, tuple[int, int]] = {}
        for _ in range(turns):
            barrier.wait(TIMEOUT)  # a turn is written; the next waits for the look
            files = _kept_files(tmp_path)
            assert {name: files.get(name) for name in kept} == kept  # none replaced
            kept = files
            barrier.wait(TIMEOUT)
        warned = dict(queue.get(timeout=TIMEOUT) for _ in processes)
    finally:
        barrier.abort()
        for process in processes:
            process.join(TIMEOUT)
    assert [p.exitcode for p in processes] == [0, 0]
    for role in (0, 1):
        assert [m for m in warned[role] if re.search(_TWIN, m)] != [], role
        assert len([m for m in warned[role] if "another writer" in m]) == 1, role
    _assert_every_row_of_both(tmp_path, turns)
