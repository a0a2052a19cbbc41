"""Distillation at scale: FSDP2 student and teacher, checkpoints saved and resumed (two CPU ranks).

One two-process run (``helpers/fsdp_distill_script.py``) fits three times in a row under
``ModelParallelStrategy``: fit 1 with a teacher sharded by ``shard_teacher=True`` saves a sharded
checkpoint (a directory); fit 2 resumes from it with a teacher sharded by the user's own policy
and saves a full checkpoint (one file); fit 3 resumes from that file with fit 2's teacher, already
sharded. The reference is the same student, teacher and connector, unsharded, trained six steps
in one go on the union of both ranks' batches: the mean of two equal-size MSE terms is the MSE of
their union, so the FSDP-averaged student gradients and the callback-averaged connector gradients
are those of the union.

Tolerance: float32 throughout; the sharded run sums in other orders (shards gathered and
reduce-scattered, gradients averaged over two ranks) than the whole-tensor reference, a few ulps
per operation, carried through six SGD-with-momentum steps of a tiny model. 1e-5 relative (and
1e-6 absolute for values near zero) is a hundred times the largest difference seen (below 1e-7)
and hundreds of times below what the failures this guards against change: a lost momentum buffer
(the connectors' or the student's) moves the next step's terms by 7e-3 to 1e-1 relative, a batch
out of place by about 0.3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers.fsdp_distill_script import (
    FITS,
    LR,
    MOMENTUM,
    PAIRS,
    STEPS_PER_FIT,
    WEIGHTS,
    Student,
    body,
    data,
    teacher,
)
from helpers.models import scalars
from helpers.scripts import run_script
from torch import nn

from lightning_recorder import FeatureDistillation, resolve_connector
from lightning_recorder.callbacks.distillation._patch import is_patched
from lightning_recorder.errors import RecorderConfigError

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = TESTS / "helpers" / "fsdp_distill_script.py"
STEPS = STEPS_PER_FIT * FITS
TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring
NO_GRAPH = {"grad_enabled": False, "requires_grad": False, "has_graph": False}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_distill")
    run_script(SCRIPT, out, timeout=300)
    assert (out / "rank0.pt").exists() and (out / "rank1.pt").exists()
    return out


def _ranks(out: Path) -> list[list[dict[str, Any]]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


class Reference:
    """The unsharded run: every logged value, and the weights after every step."""

    def __init__(self, initial_connector: dict[str, torch.Tensor]) -> None:
        student, net_teacher = body(), teacher().eval()
        x, y = data()
        width_s, width_t = student[0].out_features, net_teacher[0].out_features
        connector = resolve_connector("auto", torch.empty(1, width_s), torch.empty(1, width_t))
        connector.load_state_dict(initial_connector, strict=True)
        optimizer = torch.optim.SGD(
            [{"params": student.parameters()}, {"params": connector.parameters()}],
            lr=LR,
            momentum=MOMENTUM,
        )
        self.logged: list[dict[str, float]] = []
        self.students: list[dict[str, torch.Tensor]] = []
        self.connectors: list[dict[str, torch.Tensor]] = []
        self.momentum: list[torch.Tensor] = []
        self.validation: list[dict[str, float]] = []
        for k in range(STEPS):
            rows = torch.arange(8)  # every step: both ranks' rows (one step per epoch)
            optimizer.zero_grad()
            s0 = student[0](x[rows])
            out = student[2](student[1](s0))
            with torch.no_grad():
                t0 = net_teacher[0](x[rows])
                t2 = net_teacher(x[rows])
            mse = nn.functional.mse_loss
            terms = {
                "body.0": WEIGHTS["body.0"] * mse(connector(s0), t0),
                "body.2": WEIGHTS["body.2"] * mse(out, t2),
            }
            (mse(out, y[rows]) + sum(terms.values())).backward()
            # Rank 0 logs the terms of its own rows: every other row of the union.
            with torch.no_grad():
                mine = {
                    "body.0": WEIGHTS["body.0"] * mse(connector(s0[0::2]), t0[0::2]),
                    "body.2": WEIGHTS["body.2"] * mse(out[0::2], t2[0::2]),
                }
            logged = {f"distill/{pair}": value.item() for pair, value in mine.items()}
            logged["distill/total"] = sum(mine.values()).item()  # type: ignore[union-attr]
            self.logged.append(logged)
            optimizer.step()
            self.students.append({k: v.clone() for k, v in student.state_dict().items()})
            self.connectors.append({k: v.clone() for k, v in connector.state_dict().items()})
            self.momentum.append(optimizer.state[connector.weight]["momentum_buffer"].clone())
            # Validation after this step: the mean over the ranks (sync_dist) of each rank's
            # epoch mean (one batch of four rows) is the term over the union.
            with torch.no_grad():
                s0 = student[0](x[rows])
                out = student[2](student[1](s0))
                val = {
                    "body.0": WEIGHTS["body.0"] * mse(connector(s0), t0),
                    "body.2": WEIGHTS["body.2"] * mse(out, t2),
                }
            logged = {f"val/distill/{pair}": value.item() for pair, value in val.items()}
            logged["val/distill/total"] = sum(val.values()).item()  # type: ignore[union-attr]
            self.validation.append(logged)


@pytest.fixture(scope="module")
def reference(run: Path) -> Reference:
    initial = _ranks(run)[0][0]["initial"]
    return Reference(initial)


@pytest.mark.slow
def test_every_logged_value_equals_the_unsharded_run(run: Path, reference: Reference) -> None:
    for fit in range(FITS):
        got = scalars(run / f"fit{fit}" / "version_0")
        steps = range(STEPS_PER_FIT * fit, STEPS_PER_FIT * (fit + 1))  # the global steps
        for tag in ("distill/body.0", "distill/body.2", "distill/total"):
            axis = sorted(got[tag])
            # Lightning's logging axis: the global step, except that a run resumed from a
            # checkpoint saved at the end of an epoch, with validation on (the last fit), logs
            # one step further (Lightning's restored `_batches_that_stepped`; the same without
            # FeatureDistillation). The global steps are checked by the resume test below.
            shift = 1 if fit == FITS - 1 else 0
            assert axis == [step + shift for step in steps], (fit, tag, got[tag])
            for step, at in zip(steps, axis, strict=True):
                torch.testing.assert_close(
                    torch.tensor(got[tag][at]),
                    torch.tensor(reference.logged[step][tag]),
                    **TOL,
                    msg=lambda m, tag=tag, step=step: f"{tag} at step {step}: {m}",
                )


@pytest.mark.slow
def test_validation_terms_equal_the_unsharded_run(run: Path, reference: Reference) -> None:
    # Only the last fit distils on validation: after each of its steps (epochs), not in the
    # sanity check.
    got = scalars(run / f"fit{FITS - 1}" / "version_0")
    after = range(STEPS_PER_FIT * (FITS - 1), STEPS)
    for tag in ("val/distill/body.0", "val/distill/body.2", "val/distill/total"):
        values = [got[tag][step] for step in sorted(got[tag])]
        expected = [reference.validation[step][tag] for step in after]
        torch.testing.assert_close(torch.tensor(values), torch.tensor(expected), **TOL)
    for fit in range(FITS - 1):
        assert not [t for t in scalars(run / f"fit{fit}" / "version_0") if t.startswith("val/")]


@pytest.mark.slow
def test_the_sharded_teacher_runs_without_a_graph(run: Path) -> None:
    width = teacher()[0].out_features
    for rank, fits in enumerate(_ranks(run)):
        for fit, result in enumerate(fits):
            assert len(result["steps"]) == STEPS_PER_FIT, (rank, fit)
            for step in result["steps"]:
                # Sharded at rest over the two ranks (gathered only inside its forward).
                assert step["dtensor"], (rank, fit)
                assert step["local_shape"] == [width // 2, 8], (rank, fit)
                assert not step["any_grad"] and not step["any_requires_grad"], (rank, fit)
                assert len(step["calls"]) == 2, (rank, fit, step["calls"])  # "0" and "2", once
                for call in step["calls"]:
                    assert call == NO_GRAPH, (rank, fit)
            # Validation (last fit only): two epochs, one batch, two recorded modules each.
            assert len(result["val_calls"]) == (4 if fit == FITS - 1 else 0), (rank, fit)
            assert all(call == NO_GRAPH for call in result["val_calls"]), (rank, fit)


@pytest.mark.slow
def test_resume_restores_the_step_the_connectors_and_the_optimizer(
    run: Path, reference: Reference
) -> None:
    ranks = _ranks(run)
    for fit in range(FITS):
        first, last = STEPS_PER_FIT * fit, STEPS_PER_FIT * (fit + 1)
        for fits in ranks:
            assert (fits[fit]["start_step"], fits[fit]["end_step"]) == (first, last)
        mine, theirs = ranks[0][fit]["connectors"], ranks[1][fit]["connectors"]
        assert set(mine) == set(PAIRS)
        for pair, weights in mine.items():
            for name, value in weights.items():
                # The same broadcast start, averaged gradients and optimizer: the same bits.
                assert torch.equal(value, theirs[pair][name]), (fit, pair, name)
        torch.testing.assert_close(mine["body.0"], reference.connectors[last - 1], **TOL)
    # The connector's momentum, saved in the full checkpoint (after step 4), is the reference's.
    ckpt = torch.load(run / "ckpt" / "full.ckpt", weights_only=True)
    (state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("FeatureDistillation")]
    (saved,) = state["optimizer"]["state"]
    torch.testing.assert_close(saved["momentum_buffer"], reference.momentum[3], **TOL)
    assert state["optimizer"]["group"]["momentum"] == MOMENTUM


def _check_student(state_dict: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    fresh = Student()  # unsharded: configure_model never runs
    assert set(state_dict) == set(fresh.state_dict())
    fresh.load_state_dict(state_dict, strict=True)
    for name, value in expected.items():
        torch.testing.assert_close(fresh.state_dict()[f"body.{name}"], value, **TOL)


@pytest.mark.slow
def test_checkpoints_hold_the_student_and_no_teacher(
    run: Path, reference: Reference, tmp_path: Path
) -> None:
    # The full checkpoint (one file), saved after step 4 by fit 2.
    ckpt = torch.load(run / "ckpt" / "full.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 * STEPS_PER_FIT
    _check_student(ckpt["state_dict"], reference.students[2 * STEPS_PER_FIT - 1])
    # The optimizer states are those configure_optimizers creates: the connectors are not in.
    (optimizer,) = ckpt["optimizer_states"]
    assert [len(g["params"]) for g in optimizer["param_groups"]] == [4]
    assert set(optimizer["state"]) == {0, 1, 2, 3}
    # The sharded checkpoint (a directory), saved after step 2 by fit 1, consolidated.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "ckpt" / "sharded", tmp_path / "consolidated.pt")
    sharded = torch.load(tmp_path / "consolidated.pt", weights_only=True)
    _check_student(sharded["state_dict"], reference.students[STEPS_PER_FIT - 1])
    assert set(sharded) == {"state_dict", "optimizer_0"}
    assert set(sharded["optimizer_0"]["state"]) == set(Student().state_dict())
    # Nothing else: Lightning's entries only, and no tensor shaped as a teacher parameter (the
    # teacher's layers are 32 wide, the student's 16; the connector maps 16 to 32 features).
    meta = torch.load(run / "ckpt" / "sharded" / "meta.pt", weights_only=True)
    assert set(ckpt) == LIGHTNING_KEYS
    assert set(meta) == LIGHTNING_KEYS - {"state_dict", "optimizer_states"}
    shapes = {tuple(p.shape) for p in teacher().parameters()}
    shapes -= {tuple(p.shape) for p in Student().parameters()}
    for saved in (ckpt, meta, sharded):
        assert not [tuple(t.shape) for t in _tensors(saved) if tuple(t.shape) in shapes]


LIGHTNING_KEYS = {
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "state_dict",
    "loops",
    "callbacks",
    "optimizer_states",
    "lr_schedulers",
}


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor anywhere in ``tree``."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


# ---------------------------------------------------------------------- bad inputs (no launch)
def _trainer(*callbacks: pl.Callback, max_steps: int = 1) -> pl.Trainer:
    return pl.Trainer(
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


class Plain(Student):
    """The student without configure_model: a single-device run."""

    configure_model = pl.LightningModule.configure_model

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=4)


def test_shard_teacher_must_be_a_bool_or_a_callable() -> None:
    with pytest.raises(RecorderConfigError, match=r"Expected `shard_teacher` to be a bool or"):
        FeatureDistillation(teacher(), PAIRS, shard_teacher="yes")  # type: ignore[arg-type]


def test_shard_teacher_needs_a_strategy_with_a_device_mesh() -> None:
    net_teacher, student = teacher(), Plain()
    distill = FeatureDistillation(net_teacher, PAIRS, shard_teacher=True)
    with pytest.raises(RecorderConfigError, match=r"device mesh.*SingleDeviceStrategy"):
        _trainer(distill).fit(student, student.train_dataloader())
    # Nothing left behind: the student is unpatched, the teacher trainable and unsharded.
    assert not is_patched(student)
    assert all(p.requires_grad for p in net_teacher.parameters())
    assert not distill.connectors


def test_a_sharded_teacher_needs_a_process_group(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net_teacher = teacher()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        fully_shard(net_teacher, mesh=init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()
    student = Plain()
    trainer = _trainer(FeatureDistillation(net_teacher, PAIRS))
    with pytest.raises(RecorderConfigError, match=r"sharded with fully_shard.*no process group"):
        trainer.fit(student, student.train_dataloader())
    assert not is_patched(student)


def test_a_failing_sharded_teacher_says_it_is_sharded(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A teacher that cannot take the student's input (5 features, not 8), sharded in a process
    # group of one rank that stays up during the fit.
    wrong = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 4))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        fully_shard(wrong, mesh=init_device_mesh("cpu", (1,)))
        student = Plain()
        trainer = _trainer(FeatureDistillation(wrong, PAIRS))
        with pytest.raises(RecorderConfigError, match=r"student's input.*is sharded \(FSDP2\)"):
            trainer.fit(student, student.train_dataloader())
    finally:
        dist.destroy_process_group()
    assert not is_patched(student)


class StrayStateDict(pl.Callback):
    """Asks for the callback's state outside any checkpoint, then watches the optimizer."""

    def __init__(self, distill: FeatureDistillation) -> None:
        self.distill = distill
        self.groups: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.distill.state_dict()  # takes the connectors' group out, as for a checkpoint

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        self.groups.append(len(opt.param_groups))


def test_the_connectors_group_is_back_before_the_next_optimizer_step() -> None:
    distill = FeatureDistillation(teacher(), PAIRS)
    stray = StrayStateDict(distill)
    student = Plain()
    trainer = _trainer(distill, stray, max_steps=3)
    trainer.fit(student, student.train_dataloader())
    # Each step after a stray state_dict() still steps the connectors (the student's group and
    # the connectors' group), and the group is in the optimizer after the fit.
    assert stray.groups == [2, 2, 2]
    assert len(trainer.optimizers[0].param_groups) == 2
