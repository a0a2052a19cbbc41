"""ActivationWriter in real Trainer runs: read-back, DDP, crash, resume, bad inputs."""

from __future__ import annotations

import json
import pickle
import struct
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_recorder import (
    RecorderConfigError,
    RecorderStateError,
    RecordModifiedError,
    UnknownSourceError,
)
from lightning_recorder.activations import ActivationDataset, ShardWriter, concat_activations
from lightning_recorder.callbacks.activation_writer import ActivationWriter

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
HERE = Path(__file__).resolve().parent


class Net(pl.LightningModule):
    """A small CNN with a tuple-returning block, trainable and predictable."""

    def __init__(self, crash_at: int | None = None, crash_stage: str = "predict") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(12, 4)
        self.crash_at, self.crash_stage = crash_at, crash_stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.act(self.conv(x))).flatten(1))

    def _maybe_crash(self, stage: str, counter: int) -> None:
        if stage == self.crash_stage and counter == self.crash_at:
            raise RuntimeError(f"boom at {counter}")

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._maybe_crash("train", self.global_step)
        return self(batch[0]).square().mean()

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self(batch[0])

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._maybe_crash("predict", batch_idx)
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Indexed(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 1, 6, 6, generator=torch.Generator().manual_seed(seed))


def direct(model: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        conv = model.conv(x)
        act = model.act(conv)
        pool = model.pool(act)
        return {"conv": conv, "act": act, "pool": pool, "head": model.head(pool.flatten(1))}


def shard_header(path: Path) -> dict[str, Any]:
    """A shard's safetensors header ``{key: {"dtype", "shape", "data_offsets"}}``, read with the
    reference reader when installed, else from the documented layout (json and struct)."""
    try:
        from safetensors import safe_open
    except ImportError:  # the layout: u64 little-endian header size, then the JSON header
        data = path.read_bytes()
        size = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + size])
        header.pop("__metadata__", None)
        assert 8 + size + max([v["data_offsets"][1] for v in header.values()] + [0]) == len(data)
        return header
    with safe_open(str(path), framework="pt") as handle:
        return {k: {"shape": list(handle.get_slice(k).get_shape())} for k in handle.keys()}  # noqa: SIM118


def check_index_is_exact(directory: Path) -> None:
    """Every index file names a shard that exists, opens, and holds exactly the listed tensors."""
    for index in directory.glob("*.index.json"):
        entry = json.loads(index.read_text())
        header = shard_header(directory / entry["shard"])
        assert sorted(header) == sorted(c["key"] for c in entry["chunks"])
        for chunk in entry["chunks"]:
            assert header[chunk["key"]]["shape"] == chunk["shape"]


def test_predict_reads_back_bit_exact(tmp_path: Path) -> None:
    model, x = Net(), images(22)
    writer = ActivationWriter(
        ["conv", "act", "pool", "head"], tmp_path / "acts", max_shard_bytes=2000
    )
    trainer = pl.Trainer(**QUIET, callbacks=[writer])
    trainer.predict(model, DataLoader(TensorDataset(x), batch_size=5), return_predictions=False)
    assert writer.writer.shards_written > 2  # rolled over
    dataset = ActivationDataset(tmp_path / "acts")
    assert len(dataset) == 4 * 22
    for chunk in dataset.chunks:  # each batch against the same modules on the same batch
        rows = x[chunk["sample_index"]]
        expected = direct(model, rows)[chunk["module"]]
        got = dataset._chunk_tensor(chunk)
        assert torch.equal(got, expected), chunk["key"]
        assert chunk["stage"] == "predict" and chunk["rank"] == 0
        assert chunk["batch_idx"] == chunk["sample_index"][0] // 5
    pool = concat_activations(tmp_path / "acts", "pool")
    assert pool.shape == (22, 3, 2, 2)
    assert ActivationDataset(tmp_path / "acts", "pool").sample_indices.tolist() == list(range(22))
    assert {row["run"] for row in dataset.provenance()} == {writer.run}
    check_index_is_exact(tmp_path / "acts")


@pytest.mark.parametrize("shape", ["list", "dict"])
def test_predict_sample_indices_follow_each_dataloader_sampler(tmp_path: Path, shape: str) -> None:
    """Several predict dataloaders, one with a sampler out of order: each batch's indices are
    those its own loader's sampler drew (Lightning's public ``predict_dataloaders``)."""

    class Several(Net):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            return self(batch[0])

    x = images(12)
    order = [11, 3, 7, 0, 5, 9, 1, 10]  # a list is a sampler
    plain = DataLoader(TensorDataset(x), batch_size=5)
    drawn = DataLoader(TensorDataset(x), batch_size=3, sampler=order)
    loaders: Any = [plain, drawn] if shape == "list" else {"plain": plain, "drawn": drawn}
    writer = ActivationWriter(["pool"], tmp_path / "acts")
    pl.Trainer(**QUIET, callbacks=[writer]).predict(Several(), loaders, return_predictions=False)
    chunks = ActivationDataset(tmp_path / "acts").chunks
    by_loader: dict[int, list[int]] = {0: [], 1: []}
    for chunk in sorted(chunks, key=lambda c: (c["dataloader_idx"], c["batch_idx"])):
        by_loader[chunk["dataloader_idx"]].extend(chunk["sample_index"])
    assert by_loader == {0: list(range(12)), 1: order}


def test_structured_output_options_and_dtype(tmp_path: Path) -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.fc(x)
            return {"hidden": h.view(-1, 3, 2), "score": h.sum(1)}

    class Wrap(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.pair = Pair()

        def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> Any:
            return self.pair(batch[0])

    model, x = Wrap(), torch.randn(8, 4)
    sources = {
        "first": {"source": "pair", "path": "hidden", "tokens": 0},
        "pooled": {"source": "pair", "path": "hidden", "mean": 1, "dtype": "bfloat16"},
        "score": {"source": "pair", "path": "score"},
    }
    writer = ActivationWriter(sources, tmp_path, dtype="float16")
    pl.Trainer(**QUIET, callbacks=[writer]).predict(model, DataLoader(TensorDataset(x), 4))
    with torch.no_grad():
        hidden = torch.cat([model.pair.fc(x[i : i + 4]).view(-1, 3, 2) for i in (0, 4)])
    # The same operations on the same batches as the writer ran: exact in the stored dtype.
    assert torch.equal(concat_activations(tmp_path, "first"), hidden[:, 0].half())
    assert torch.equal(concat_activations(tmp_path, "pooled"), hidden.mean(1).bfloat16())
    score = concat_activations(tmp_path, "score")
    assert score.dtype == torch.float16 and score.shape == (8,)


def test_training_every_n_steps_with_sample_index_and_val(tmp_path: Path) -> None:
    x = images(16)
    loader = DataLoader(Indexed(x), batch_size=4, shuffle=True)
    writer = ActivationWriter(
        "pool", tmp_path, stages=("train", "val"), every_n_steps=2, sample_index=1
    )
    trainer = pl.Trainer(**QUIET, callbacks=[writer], max_epochs=2, num_sanity_val_steps=2)
    trainer.fit(Net(), loader, DataLoader(Indexed(x[:8]), batch_size=4))
    rows = ActivationDataset(tmp_path).provenance()
    train = [r for r in rows if r["stage"] == "train"]
    assert sorted({r["global_step"] for r in train}) == [1, 3, 5, 7]  # (k + 1) % 2 == 0
    for step in (1, 3, 5, 7):  # each training batch is 4 distinct samples of the epoch
        indices = [r["sample_index"] for r in train if r["global_step"] == step]
        assert len(set(indices)) == 4
    val = [r for r in rows if r["stage"] == "val"]
    assert Counter(r["global_step"] for r in val) == {4: 8, 8: 8}  # no sanity-check rows
    assert sorted(r["sample_index"] for r in val if r["global_step"] == 4) == list(range(8))


def test_resume_from_checkpoint_without_duplicates(tmp_path: Path) -> None:
    x, acts = images(32), tmp_path / "acts"
    loader = DataLoader(Indexed(x), batch_size=4)
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = ActivationWriter("pool", acts, stages="train", sample_index=1)
    trainer = pl.Trainer(
        **{**QUIET, "enable_checkpointing": True}, callbacks=[first, checkpoints], max_steps=8
    )
    with pytest.raises(RuntimeError, match=r"boom at 7"):
        trainer.fit(Net(crash_at=7, crash_stage="train"), loader)
    steps = [r["global_step"] for r in ActivationDataset(acts).provenance()]
    assert sorted(set(steps)) == list(range(7))  # what ran before the crash was written
    resumed = ActivationWriter("pool", acts, stages="train", sample_index=1)
    trainer = pl.Trainer(
        **{**QUIET, "enable_checkpointing": True}, callbacks=[resumed], max_steps=8
    )
    trainer.fit(Net(), loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=6.ckpt")
    rows = ActivationDataset(acts).provenance()
    assert {r["run"] for r in rows} == {first.run} == {resumed.run}
    keys = Counter((r["global_step"], r["sample_index"]) for r in rows)
    assert max(keys.values()) == 1  # no duplicates
    assert sorted({step for step, _ in keys}) == list(range(8))
    for step in range(8):  # one batch of 4 per step (the resumed steps re-read the loader)
        assert len([i for s, i in keys if s == step]) == 4
    check_index_is_exact(acts)


def _fit_three_epochs(writer: ActivationWriter, loader: DataLoader[Any], root: Path) -> None:
    """Steps 0 to 5; the checkpoint after each epoch starts a new generation (0, 1 and 2)."""
    options = {**QUIET, "enable_checkpointing": True, "default_root_dir": root}
    trainer = pl.Trainer(**options, callbacks=[writer], max_epochs=3, limit_train_batches=2)
    trainer.fit(Net(), loader)


def test_the_tuner_after_a_fit_of_the_same_run_keeps_its_rows(tmp_path: Path) -> None:
    # The Tuner saves a checkpoint and restores it into the writer; the fit after it must not
    # take that for a resume that removes the earlier fit's shards of later generations.
    from lightning.pytorch.tuner import Tuner

    loader, acts = DataLoader(Indexed(images(16)), batch_size=4), tmp_path / "acts"
    writer = ActivationWriter("pool", acts, stages="train", sample_index=1)
    _fit_three_epochs(writer, loader, tmp_path)
    trainer = pl.Trainer(**QUIET, callbacks=[writer], max_steps=2, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the finder's: too few points for a suggestion
        Tuner(trainer).lr_find(
            Net(), loader, num_training=2, early_stop_threshold=None, update_attr=False
        )
        trainer.fit(Net(), loader)
    steps = Counter(r["global_step"] for r in ActivationDataset(acts).provenance())
    assert sorted(steps.items()) == [(0, 8), (1, 8), (2, 4), (3, 4), (4, 4), (5, 4)]
    check_index_is_exact(acts)


def test_a_later_fit_reads_one_index_file_per_rank_for_its_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the generation goes on from the run's last shard of each rank: one read per rank at
    # setup, not one per shard (a run of thousands of shards on an object store)
    from lightning_recorder.activations._format import Storage

    loader, acts = DataLoader(Indexed(images(16)), batch_size=4), tmp_path / "acts"
    first = ActivationWriter("pool", acts, "train", run="r", max_shard_bytes=1)
    _fit_three_epochs(first, loader, tmp_path)
    assert len(list(acts.glob("*.index.json"))) == 6  # a shard a step; generations 0, 1, 2
    reads: list[str] = []
    read = Storage.read
    monkeypatch.setattr(Storage, "read", lambda self, name: reads.append(name) or read(self, name))
    later = ActivationWriter("pool", acts, "train", run="r")
    trainer = pl.Trainer(**QUIET, callbacks=[later], max_steps=1)
    later.setup(trainer, Net(), "fit")
    assert reads == ["r-rank00000-000005.index.json"] and later.writer.generation == 3


def test_a_resume_removes_the_rows_after_its_checkpoint_only(tmp_path: Path) -> None:
    # A second fit of the same run crashes and resumes from its own checkpoint: the rows it
    # wrote after that checkpoint go, the first fit's stay.
    loader, acts = DataLoader(Indexed(images(16)), batch_size=4), tmp_path / "acts"
    _fit_three_epochs(
        ActivationWriter("pool", acts, "train", run="r", sample_index=1), loader, tmp_path
    )
    saves = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    options = {**QUIET, "enable_checkpointing": True}
    second = ActivationWriter("pool", acts, "train", run="r", sample_index=1)
    with pytest.raises(RuntimeError, match=r"boom at 2"):
        pl.Trainer(**options, callbacks=[second, saves], max_steps=3).fit(
            Net(crash_at=2, crash_stage="train"), loader
        )
    resumed = ActivationWriter("pool", acts, "train", run="r", sample_index=1)
    pl.Trainer(**options, callbacks=[resumed], max_steps=3).fit(
        Net(), loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=1.ckpt"
    )
    steps = Counter(r["global_step"] for r in ActivationDataset(acts).provenance())
    assert sorted(steps.items()) == [(0, 8), (1, 8), (2, 8), (3, 4), (4, 4), (5, 4)]
    check_index_is_exact(acts)


def test_loops_from_a_checkpoint_of_the_fit_keep_the_fits_rows(tmp_path: Path) -> None:
    # validate/predict(ckpt_path=...) restore the writer's state too, but resume no training: the
    # rows the fit wrote after that checkpoint stay.
    loader, acts = DataLoader(Indexed(images(16)), batch_size=4), tmp_path / "acts"
    writer = ActivationWriter("pool", acts, ("train", "val", "predict"), sample_index=1)
    every = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1)
    options = {**QUIET, "enable_checkpointing": True}
    trainer = pl.Trainer(**options, callbacks=[writer, every], max_epochs=3, limit_train_batches=2)
    trainer.fit(Net(), loader)
    first = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rows are added to the run's: said once a loop
        trainer.validate(Net(), loader, ckpt_path=first, verbose=False)
        trainer.predict(Net(), loader, ckpt_path=first, return_predictions=False)
    rows = ActivationDataset(acts).provenance()
    assert {r["run"] for r in rows} == {writer.run}
    steps = Counter((r["stage"], r["global_step"]) for r in rows if r["stage"] == "train")
    assert sorted(steps.items()) == [(("train", step), 4) for step in range(6)]
    assert Counter(r["stage"] for r in rows) == {"train": 24, "val": 16, "predict": 16}
    check_index_is_exact(acts)


def test_resume_from_a_checkpoint_saved_by_an_earlier_callback_at_batch_end(
    tmp_path: Path,
) -> None:
    # A callback listed before the writer saves in on_train_batch_end: the checkpoint holds that
    # batch as done (a resume does not run it again), so its rows must be kept.
    class SaveAtStep3(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                trainer.save_checkpoint(tmp_path / "step3.ckpt")

    x, acts = images(32), tmp_path / "acts"
    loader = DataLoader(Indexed(x), batch_size=4)
    first = ActivationWriter("pool", acts, stages="train", sample_index=1)
    pl.Trainer(**QUIET, callbacks=[SaveAtStep3(), first], max_steps=5).fit(Net(), loader)
    resumed = ActivationWriter("pool", acts, stages="train", sample_index=1)
    trainer = pl.Trainer(**QUIET, callbacks=[resumed], max_steps=6)
    trainer.fit(Net(), loader, ckpt_path=tmp_path / "step3.ckpt")
    keys = Counter(
        (r["global_step"], r["sample_index"]) for r in ActivationDataset(acts).provenance()
    )
    assert max(keys.values()) == 1
    assert sorted(Counter(step for step, _ in keys).items()) == [(step, 4) for step in range(6)]
    assert first.recorded_steps == 5 and resumed.recorded_steps == 6


def test_resume_with_another_run_id_warns_that_it_continues_the_checkpoints(
    tmp_path: Path,
) -> None:
    loader, acts = DataLoader(Indexed(images(16)), batch_size=4), tmp_path / "acts"
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = ActivationWriter("pool", acts, stages="train", sample_index=1, run="first")
    quiet = {**QUIET, "enable_checkpointing": True}
    pl.Trainer(**quiet, callbacks=[first, checkpoints], max_steps=4).fit(Net(), loader)
    resumed = ActivationWriter("pool", acts, stages="train", sample_index=1, run="second")
    trainer = pl.Trainer(**QUIET, callbacks=[resumed], max_steps=4)
    with pytest.warns(UserWarning, match=r"checkpoint of run 'first'.*not `run='second'`"):
        trainer.fit(Net(), loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    rows = ActivationDataset(acts).provenance()
    assert resumed.run == "first" and {r["run"] for r in rows} == {"first"}
    assert max(Counter((r["global_step"], r["sample_index"]) for r in rows).values()) == 1


def test_resume_with_another_source_continues_the_run_of_the_checkpoint(tmp_path: Path) -> None:
    """A writer resumed with other sources or stages (so another ``state_key``) into the same
    directory takes the checkpoint's run there, with a warning: no row is written twice."""
    loader, acts = DataLoader(Indexed(images(16)), batch_size=4), tmp_path / "acts"
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = ActivationWriter("pool", acts, stages="train", sample_index=1)
    quiet = {**QUIET, "enable_checkpointing": True}
    pl.Trainer(**quiet, callbacks=[first, checkpoints], max_steps=4).fit(Net(), loader)
    resumed = ActivationWriter(["pool", "conv"], acts, stages=("train", "val"), sample_index=1)
    other = ActivationWriter("pool", tmp_path / "elsewhere", stages="train")  # not that directory
    trainer = pl.Trainer(**QUIET, callbacks=[resumed, other], max_steps=4)
    with pytest.warns(UserWarning, match=r"continues run '\w+' of the checkpoint's Activation"):
        trainer.fit(Net(), loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert resumed.run == first.run and other.run != first.run
    rows = ActivationDataset(acts, sources="pool").provenance()
    assert {r["run"] for r in rows} == {first.run}
    keys = Counter((r["global_step"], r["sample_index"]) for r in rows)
    assert max(keys.values()) == 1 and sorted(Counter(s for s, _ in keys).values()) == [4] * 4
    conv = ActivationDataset(acts, sources="conv").provenance()
    assert sorted({r["global_step"] for r in conv}) == [2, 3]  # written from the resume on
    # two writers into that directory could both take it: neither does (nor one with a `name`)
    pair = [ActivationWriter("conv", acts, stages="train"), ActivationWriter("act", acts)]
    named = ActivationWriter("pool", acts, stages="val", name="new")
    trainer = pl.Trainer(**QUIET, callbacks=[*pair, named], max_steps=4)
    trainer.fit(Net(), loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert first.run not in {pair[0].run, pair[1].run, named.run}
    # `validate` with a checkpoint continues no run: it takes nothing, and says nothing
    checking = ActivationWriter(["pool", "conv"], acts, stages="val")
    trainer = pl.Trainer(**QUIET, callbacks=[checking])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.validate(Net(), loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert not [w for w in seen if "continues run" in str(w.message)]
    assert checking.run != first.run


def test_resume_on_fewer_processes_removes_the_stale_shards_of_the_ranks_gone(
    tmp_path: Path,
) -> None:
    loader, acts = DataLoader(Indexed(images(16)), batch_size=4), tmp_path / "acts"
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = ActivationWriter("pool", acts, stages="train", sample_index=1)
    quiet = {**QUIET, "enable_checkpointing": True}
    pl.Trainer(**quiet, callbacks=[first, checkpoints], max_steps=4).fit(Net(), loader)
    # What a second process of that run wrote before (generation 0) and after (1, 2) the
    # checkpoint of step 2, which stored generation 1.
    for generation, step in ((0, 0), (1, 2), (2, 3)):
        with ShardWriter(acts, run=first.run, rank=1, generation=generation) as other:
            other.write("pool", "pool", torch.ones(2, 3, 2, 2), stage="train", global_step=step)
    resumed = ActivationWriter("pool", acts, stages="train", sample_index=1)
    trainer = pl.Trainer(**QUIET, callbacks=[resumed], max_steps=4)
    trainer.fit(Net(), loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    rows = ActivationDataset(acts).provenance()
    assert sorted(Counter((r["rank"], r["global_step"]) for r in rows).items()) == [
        ((0, 0), 4),
        ((0, 1), 4),
        ((0, 2), 4),
        ((0, 3), 4),
        ((1, 0), 2),
    ]
    check_index_is_exact(acts)


def test_crash_mid_predict_leaves_complete_shards_and_exact_index(tmp_path: Path) -> None:
    x = images(40)
    writer = ActivationWriter(["conv", "head"], tmp_path, max_shard_bytes=3000)
    trainer = pl.Trainer(**QUIET, callbacks=[writer])
    with pytest.raises(RuntimeError, match=r"boom at 5"):
        trainer.predict(Net(crash_at=5), DataLoader(TensorDataset(x), batch_size=4))
    assert writer.writer._thread is not None and not writer.writer._thread.is_alive()
    check_index_is_exact(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    dataset = ActivationDataset(tmp_path, "head")
    assert dataset.sample_indices.tolist() == list(range(20))  # batches 0-4, each once
    assert torch.equal(
        dataset.concat(), torch.cat([direct(Net(), x[i : i + 4])["head"] for i in range(0, 20, 4)])
    )


def test_bad_inputs(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RecorderConfigError, match=r"to be a writable directory"):
        ActivationWriter("conv", blocker / "acts")
    with pytest.raises(RecorderConfigError, match=r"Expected `queue_full` .* but got 'block'"):
        ActivationWriter("conv", tmp_path, queue_full="block")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `sources` of ActivationWriter"):
        ActivationWriter([], tmp_path)
    with pytest.raises(RecorderConfigError, match=r"options among path, tokens.* 'reduce'"):
        ActivationWriter({"f": {"source": "conv", "reduce": "mean"}}, tmp_path)
    with pytest.raises(RecorderConfigError, match=r"Expected `stages` of ActivationWriter"):
        ActivationWriter("conv", tmp_path, stages="predicting")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `sample_index`"):
        ActivationWriter("conv", tmp_path, sample_index=True)  # type: ignore[arg-type]
    writer = ActivationWriter(["conv", "head_typo"], tmp_path / "unknown")
    trainer = pl.Trainer(**QUIET, callbacks=[writer])
    with pytest.raises(UnknownSourceError, match=r"head_typo.*'head'"):
        trainer.predict(Net(), DataLoader(TensorDataset(images(4)), batch_size=4))
    assert writer.writer._thread is None  # nothing started, nothing written
    assert not list((tmp_path / "unknown").iterdir())


def test_sample_indices_that_are_not_integers_are_refused(tmp_path: Path) -> None:
    """A `sample_index` giving floats (the batch's inputs, a float target) is an error, not
    indices truncated to ints without a word."""
    x = images(8)
    writer = ActivationWriter(
        "conv", tmp_path / "acts", stages="train", sample_index=lambda batch, i: batch[1]
    )
    trainer = pl.Trainer(**QUIET, max_steps=2, callbacks=[writer])
    data = TensorDataset(x, torch.linspace(0.5, 7.5, 8))  # float targets, not indices
    with pytest.raises(RecorderConfigError, match=r"integer dataset indices .* torch\.float32"):
        trainer.fit(Net(), DataLoader(data, batch_size=4))
    assert not list((tmp_path / "acts").glob("*.index.json"))  # no row written
    with ShardWriter(tmp_path / "plain") as plain:
        with pytest.raises(RecorderConfigError, match=r"integer dataset indices .* 1\.5 \(float\)"):
            plain.write("s", "m", torch.zeros(2, 3), sample_index=[0, 1.5])
        for mask in (torch.tensor([True, False]), [True, False]):  # a mask reads as 1 and 0
            with pytest.raises(RecorderConfigError, match=r"integer dataset indices .*bool"):
                plain.write("s", "m", torch.zeros(2, 3), sample_index=mask)
        plain.write("s", "m", torch.zeros(2, 3), sample_index=torch.tensor([4, 5]))
    assert concat_activations(tmp_path / "plain", "s").shape == (2, 3)
    assert [row["sample_index"] for row in ActivationDataset(tmp_path / "plain")] == [4, 5]


@pytest.mark.parametrize(
    "sample_index",
    [lambda batch, batch_idx: batch[1], lambda batch: batch[1]],
    ids=["batch-and-index", "batch-alone"],
)
def test_sample_indices_come_from_a_function_of_the_batch(
    tmp_path: Path, sample_index: Any
) -> None:
    x = images(8)
    writer = ActivationWriter("conv", tmp_path / "acts", stages="train", sample_index=sample_index)
    trainer = pl.Trainer(**QUIET, max_steps=2, callbacks=[writer])
    data = TensorDataset(x, torch.arange(10, 18))
    trainer.fit(Net(), DataLoader(data, batch_size=4))
    rows = ActivationDataset(tmp_path / "acts")
    assert sorted(row["sample_index"] for row in rows) == list(range(10, 18))


def test_in_place_change_after_the_recorded_module_is_caught_or_cloned(tmp_path: Path) -> None:
    class InPlace(Net):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU(inplace=True)

    x = images(4)
    writer = ActivationWriter("conv", tmp_path / "a")
    # Tensors made under inference mode (Lightning's default for predict) have no version
    # counter, so the check needs `inference_mode=False`; `clone=True` works either way.
    trainer = pl.Trainer(**QUIET, callbacks=[writer], inference_mode=False)
    with pytest.raises(RecordModifiedError, match=r"clone=True"):
        trainer.predict(InPlace(), DataLoader(TensorDataset(x), 4))
    writer = ActivationWriter("conv", tmp_path / "b", clone=True)
    pl.Trainer(**QUIET, callbacks=[writer]).predict(InPlace(), DataLoader(TensorDataset(x), 4))
    with torch.no_grad():
        expected = InPlace().conv(x)
    assert torch.equal(concat_activations(tmp_path / "b", "conv"), expected)


def test_writer_pickles_for_ddp_spawn_and_the_copy_writes(tmp_path: Path) -> None:
    # `ddp_spawn` pickles the callbacks into its processes before any of them writes.
    writer = ActivationWriter("head", tmp_path, run="spawned")
    copy = pickle.loads(pickle.dumps(writer))
    x = images(6)
    pl.Trainer(**QUIET, callbacks=[copy]).predict(Net(), DataLoader(TensorDataset(x), 4))
    assert copy.writer._thread is not None and not copy.writer._thread.is_alive()
    assert concat_activations(tmp_path, "head").shape == (6, 4)
    assert writer.writer._thread is None  # the original wrote nothing
    pickle.loads(pickle.dumps(copy))  # closed after the run: copies again


def test_shard_writer_refuses_to_pickle_while_writing(tmp_path: Path) -> None:
    shard_writer = ShardWriter(tmp_path, run="busy")
    shard_writer.write("f", "m", torch.ones(2, 3), stage="predict")
    with pytest.raises(RecorderStateError, match=r"closed before it is copied or pickled"):
        pickle.dumps(shard_writer)
    shard_writer.close()
    assert len(ActivationDataset(tmp_path)) == 2


def test_a_run_id_with_shards_already_written_warns_that_rows_are_added(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(images(6)), batch_size=4)
    writer = ActivationWriter("head", tmp_path, run="fixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**QUIET, callbacks=[writer]).predict(Net(), loader)
    assert not [w for w in caught if "already holds" in str(w.message)]  # a fresh directory
    again = ActivationWriter("head", tmp_path, run="fixed")
    with pytest.warns(UserWarning, match=r"holds 1 shard\(s\) of run 'fixed'.*another `run`"):
        pl.Trainer(**QUIET, callbacks=[again]).predict(Net(), loader)
    with pytest.warns(UserWarning, match=r"already holds 2 shard\(s\)"):  # the same writer again
        pl.Trainer(**QUIET, callbacks=[again]).predict(Net(), loader)
    assert len(ActivationDataset(tmp_path)) == 3 * 6  # added, as the warning says
    fresh = ActivationWriter("head", tmp_path)  # another run id: nothing to warn about
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**QUIET, callbacks=[fresh]).predict(Net(), loader)
    assert not [w for w in caught if "already holds" in str(w.message)]


def test_two_writers_of_one_run_into_one_directory_are_refused_before_writing(
    tmp_path: Path,
) -> None:
    """Two writers of one run and rank number their shards alike: each would replace the
    other's shards (rows lost without a word, or a failed rename)."""
    data = DataLoader(TensorDataset(images(40)), batch_size=5)
    options: dict[str, Any] = {"run": "exp", "max_shard_bytes": 200, "fsync": False}
    writers = [
        ActivationWriter("conv", tmp_path, **options),
        ActivationWriter("head", tmp_path, **options),
    ]
    trainer = pl.Trainer(**QUIET, callbacks=writers)
    with pytest.raises(RecorderConfigError, match=r"own `run` .*\['conv'\] and \['head'\]"):
        trainer.predict(Net(), data, return_predictions=False)
    assert not list(tmp_path.iterdir())  # nothing written
    writers[1] = ActivationWriter("head", tmp_path, **{**options, "run": "other"})
    pl.Trainer(**QUIET, callbacks=writers).predict(Net(), data, return_predictions=False)
    assert Counter(c["source"] for c in ActivationDataset(tmp_path).provenance()) == {
        "conv": 40,
        "head": 40,
    }


def test_fast_dev_run_checks_the_tensors_as_a_write_would(tmp_path: Path) -> None:
    """The smoke test writes nothing but still catches what would stop the real run."""
    loader = DataLoader(TensorDataset(images(8)), batch_size=4)
    bad_rows = ActivationWriter("head", tmp_path, sample_index=lambda batch, idx: [0, 1, 2])
    with pytest.raises(RecorderConfigError, match=r"one row per sample"):
        pl.Trainer(**QUIET, fast_dev_run=True, callbacks=[bad_rows]).predict(Net(), loader)
    to_complex = {"source": "head", "transform": lambda t: t.to(torch.complex64)}
    bad_dtype = ActivationWriter({"head": to_complex}, tmp_path)
    with pytest.raises(RecorderConfigError, match=r"complex64"):
        pl.Trainer(**QUIET, fast_dev_run=True, callbacks=[bad_dtype]).predict(Net(), loader)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("fast_dev_run", [True, 2])
def test_fast_dev_run_writes_no_shard_and_says_so(
    tmp_path: Path, fast_dev_run: bool | int, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning's smoke test writes no logs or checkpoints: the writer writes no shards either
    (its sources are still recorded), and removes none on a resume."""
    loader = DataLoader(TensorDataset(images(12)), batch_size=4)
    dataset = tmp_path / "dataset"
    kept = ActivationWriter("head", dataset, run="kept")  # a dataset already there
    pl.Trainer(**QUIET, callbacks=[kept]).predict(Net(), loader)
    before = sorted(p.name for p in dataset.iterdir())
    smoke = tmp_path / "smoke"
    writer = ActivationWriter(["conv", "head"], smoke, stages=("train", "val", "predict"))
    trainer = pl.Trainer(**QUIET, fast_dev_run=fast_dev_run, callbacks=[writer])
    with caplog.at_level("INFO"):
        trainer.fit(Net(), loader, loader)
        trainer.predict(Net(), loader)
    assert writer.recorded_steps == int(fast_dev_run)  # the sources were recorded
    assert not list(smoke.iterdir())
    told = [r for r in caplog.records if "writes no activations under `fast_dev_run`" in r.message]
    assert len(told) == 2  # once per loop
    # a resume under fast_dev_run removes nothing of the run it would continue
    resumed = ActivationWriter("head", dataset, run="kept")
    resumed.load_state_dict({"recorded_steps": 0, "run": "kept", "generation": 0})
    pl.Trainer(**QUIET, fast_dev_run=fast_dev_run, callbacks=[resumed]).fit(Net(), loader)
    assert sorted(p.name for p in dataset.iterdir()) == before
    assert len(ActivationDataset(dataset)) == 12
