"""FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) on two CPU processes, values known ahead.

Parameter norms, gradient norms and update ratios must be those of the full tensors (reduced over
the shards), feature statistics over both ranks' data; the reference is the same model,
unsharded, trained on the union of both ranks' batches (the mean of two equal-size MSE losses is
the MSE of their union, so the gradients agree). Tolerance: 1e-5 relative — float32 sums over a
few hundred elements, reduced in a different order across the shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fsdp_script import LR, MONITORED, STEPS, body, data
from helpers.models import reference_stats, scalars
from helpers.scripts import run_script
from torch import nn

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = TESTS / "helpers" / "fsdp_script.py"


def _run(out: Path, *flags: str) -> dict[str, dict[int, float]]:
    run_script(SCRIPT, out, *flags)
    assert (out / "done0").exists() and (out / "done1").exists()
    return scalars(out / "fsdp" / "version_0")


def _reference() -> list[dict[str, float]]:
    """Per step, every logged value of the unsharded model trained on both ranks' rows."""
    model = nn.ModuleDict({"body": body()})
    x, y = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outputs: dict[str, torch.Tensor] = {}
    for name in MONITORED:
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, out.detach().clone())
        )
    steps = []
    for k in range(STEPS):
        rows = torch.arange(8 * k, 8 * k + 8)
        optimizer.zero_grad()
        nn.functional.mse_loss(model["body"](x[rows]), y[rows]).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        optimizer.step()
        values: dict[str, float] = {}
        for name in MONITORED:
            for stat, value in reference_stats(outputs[name]).items():
                values[f"stats/train/{name}/{stat}"] = value
        for n, p in model.named_parameters():
            values[f"stats/train/{n}/norm"] = p.norm().item()
            values[f"stats/train/{n}/grad_norm"] = grads[n]
            change = (p.detach() - before[n]).norm() / before[n].norm()
            values[f"stats/train/{n}/update_ratio"] = change.item()
        steps.append(values)
    return steps


@pytest.mark.slow
def test_monitor_under_fsdp2_logs_the_full_tensors(tmp_path: Path) -> None:
    got = _run(tmp_path)
    for step, expected in enumerate(_reference()):
        for tag, value in expected.items():
            if tag.rsplit("/", 1)[-1] not in (
                "mean",
                "std",
                "min",
                "max",
                "abs_mean",
                "zero_fraction",
                "nonfinite",
                "norm",
                "grad_norm",
                "update_ratio",
            ):
                continue
            assert tag in got, f"{tag} not logged; logged: {sorted(got)[:12]}"
            # FSDP shards and all-gathers float32 tensors, the reference runs whole: other
            # summation orders (a few ulps per term), so 1e-5 relative; abs for values near zero.
            assert got[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-7), (tag, step)


@pytest.mark.slow
def test_distillation_with_a_sharded_student_matches_the_unsharded_run(tmp_path: Path) -> None:
    got = _run(tmp_path, "--distill")
    student = body()
    teacher = body(width=32, seed=3).eval()
    x, y = data()
    optimizer = torch.optim.SGD(student.parameters(), lr=LR)
    for k in range(STEPS):
        rows = torch.arange(8 * k, 8 * k + 8)
        optimizer.zero_grad()
        out = student(x[rows])
        with torch.no_grad():
            target = teacher(x[rows])
        # Each rank adds 0.5 * MSE of its own rows; DDP-style averaging of equal-size ranks
        # gives the mean of the two ranks' terms, i.e. the term over the union.
        term = 0.5 * nn.functional.mse_loss(out, target)
        (nn.functional.mse_loss(out, y[rows]) + term).backward()
        # Rank 0 logs the term of its own rows (8k, 8k + 2, …: every other row of the union).
        rank0 = 0.5 * nn.functional.mse_loss(out[0::2], target[0::2]).item()
        # The sharded student against this unsharded replay: float32, other reduction orders,
        # and the error of earlier steps carried through the weights: 1e-5 relative.
        assert got["distill/body.2"][k] == pytest.approx(rank0, rel=1e-5), k
        optimizer.step()
