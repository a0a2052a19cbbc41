"""Distillation losses: values against straightforward computations, gradients, errors, resolver."""

from __future__ import annotations

import doctest
import functools
import math
import pydoc
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import lightning_recorder.distill.losses as losses_module
from lightning_recorder import build_connector
from lightning_recorder.distill.losses import (
    AttentionTransferLoss,
    CosineLoss,
    KLDivLoss,
    L1Loss,
    MSELoss,
    attention_transfer_loss,
    cosine_loss,
    get_loss,
    kl_div_loss,
    l1_loss,
    mse_loss,
)
from lightning_recorder.errors import RecorderConfigError, UnknownRecorderTypeError

SHAPES = [(4, 6), (3, 5, 6), (2, 6, 3, 5)]  # (N, C), (N, L, C), (N, C, H, W)


def _pair(shape: tuple[int, ...], seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _to_rows(x: Tensor) -> Tensor:
    """(positions, channels) by hand: channels last for 3-D, dim 1 otherwise."""
    if x.ndim == 3:
        return x.reshape(-1, x.shape[-1])
    return x.transpose(1, -1).reshape(-1, x.shape[1]) if x.ndim > 2 else x


def test_docstring_examples_run() -> None:
    result = doctest.testmod(losses_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 15
    assert result.failed == 0


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("shape", SHAPES)
def test_mse_and_l1_match_elementwise_means(shape: tuple[int, ...]) -> None:
    s, t = _pair(shape)
    torch.testing.assert_close(mse_loss(s, t), ((s - t) ** 2).sum() / s.numel())
    torch.testing.assert_close(l1_loss(s, t), (s - t).abs().sum() / s.numel())
    torch.testing.assert_close(MSELoss()(s, t), mse_loss(s, t))
    torch.testing.assert_close(L1Loss()(s, t), l1_loss(s, t))


@pytest.mark.parametrize("shape", SHAPES)
def test_cosine_is_one_minus_similarity_over_channels(shape: tuple[int, ...]) -> None:
    s, t = _pair(shape)
    rs, rt = _to_rows(s), _to_rows(t)
    cos = (rs * rt).sum(1) / (rs.norm(dim=1) * rt.norm(dim=1))
    expected = (1 - cos).mean()
    torch.testing.assert_close(cosine_loss(s, t), expected)
    torch.testing.assert_close(CosineLoss()(s, t), expected)


def test_cosine_explicit_dim_and_known_value() -> None:
    s = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    t = torch.tensor([[0.0, 3.0], [2.0, 2.0]])
    torch.testing.assert_close(cosine_loss(s, t), torch.tensor(0.5))
    # dim=0 compares the columns instead: [1, 1]·[0, 2] and [0, 1]·[3, 2]
    col0 = 1 - 2 / (math.sqrt(2) * 2)
    col1 = 1 - 2 / (1 * math.sqrt(13))
    expected = torch.tensor((col0 + col1) / 2)
    torch.testing.assert_close(cosine_loss(s, t, dim=0), expected)
    torch.testing.assert_close(CosineLoss(dim=-2)(s, t), expected)


@pytest.mark.parametrize(("shape", "dim"), [((8, 1), 1), ((2, 1, 4, 4), 1), ((2, 5, 1), 2)])
def test_cosine_of_one_channel_is_refused(shape: tuple[int, ...], dim: int) -> None:
    # the cosine of two numbers is -1 or 1: the loss was 0 or 2 with no gradient, without a word
    student, teacher = _pair(shape, seed=10)
    with pytest.raises(
        RecorderConfigError,
        match=rf"Expected cosine_loss features with at least 2 channels on dim {dim} but got "
        + re.escape(f"shape {shape}: the cosine of two numbers is -1 or 1")
        + r".*mse_loss or l1_loss, or pass `dim`",
    ):
        CosineLoss()(student, teacher)
    if len(shape) == 4:  # another dim of the same features holds several values
        assert torch.isfinite(cosine_loss(student, teacher, dim=2))


def _manual_attention(x: Tensor, p: float) -> Tensor:
    n = x.shape[0]
    rows = []
    for i in range(n):
        sample = x[i]
        # tokens (L, C): average over C; maps (C, H, W): average over C
        amap = (sample.abs() ** p).mean(-1) if x.ndim == 3 else (sample.abs() ** p).mean(0)
        amap = amap.reshape(-1)
        rows.append(amap / math.sqrt(float((amap**2).sum())))
    return torch.stack(rows)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
@pytest.mark.parametrize(
    ("s_shape", "t_shape"), [((2, 6, 3, 5), (2, 9, 3, 5)), ((3, 7, 4), (3, 7, 10))]
)
def test_attention_transfer_matches_manual_maps(
    s_shape: tuple[int, ...], t_shape: tuple[int, ...], p: float
) -> None:
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(s_shape, generator=gen), torch.randn(t_shape, generator=gen)
    diff = _manual_attention(s, p) - _manual_attention(t, p)
    torch.testing.assert_close(attention_transfer_loss(s, t, p=p), (diff**2).mean())
    l2 = torch.tensor([math.sqrt(float((row**2).sum())) for row in diff]).mean()
    torch.testing.assert_close(attention_transfer_loss(s, t, p=p, distance="l2"), l2)
    module = AttentionTransferLoss(p=p, distance="l2")
    torch.testing.assert_close(module(s, t), l2)


def test_attention_transfer_known_value() -> None:
    s = torch.tensor([[[[1.0, 1.0]]]])  # map [1, 1] / sqrt(2)
    t = torch.tensor([[[[2.0, 0.0]], [[-2.0, 0.0]]]])  # map [1, 0]
    expected = (2 - math.sqrt(2)) / 2
    assert attention_transfer_loss(s, t).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0])
def test_attention_transfer_gradient_is_finite_at_zero_features(p: float) -> None:
    # ReLU features hold exact zeros, where |x| ** p has an infinite slope for p < 1: the
    # gradient of every zero feature was NaN, and the optimizer spread it to the weights
    gen = torch.Generator().manual_seed(8)
    student = torch.randn(2, 4, 3, 3, generator=gen, dtype=torch.float64).relu()
    teacher = torch.randn(2, 8, 3, 3, generator=gen, dtype=torch.float64)
    assert (student == 0).any()
    leaf = student.clone().requires_grad_()
    value = attention_transfer_loss(leaf, teacher, p=p)
    diff = _manual_attention(student, p) - _manual_attention(teacher, p)
    torch.testing.assert_close(value.detach(), (diff**2).mean(), rtol=1e-12, atol=0)
    value.backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    assert (leaf.grad[student == 0] == 0).all()
    # at the other features the gradient is the analytic one (central differences, float64)
    mask = student != 0
    values = student[mask].clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v: attention_transfer_loss(student.masked_scatter(mask, v), teacher, p=p),
        (values,),
    )
    # a NaN feature is not a zero one: the loss stays NaN
    student[0, 0, 0, 0] = math.nan
    assert attention_transfer_loss(student, teacher, p=p).isnan()


def test_attention_transfer_p2_equals_reference_implementation() -> None:
    """The authors' code: at(x) = normalize(x.pow(2).mean(1).view(N, -1)); (at(s)-at(t))^2 mean."""
    s, t = torch.randn(4, 8, 6, 6), torch.randn(4, 16, 6, 6)

    def at(x: Tensor) -> Tensor:
        return F.normalize(x.pow(2).mean(1).view(x.size(0), -1))

    torch.testing.assert_close(attention_transfer_loss(s, t), (at(s) - at(t)).pow(2).mean())


def _manual_kl(s: Tensor, t: Tensor, temperature: float) -> Tensor:
    rs, rt = _to_rows(s) / temperature, _to_rows(t) / temperature
    p_t = rt.softmax(1)
    per_row = (p_t * (p_t.log() - rs.log_softmax(1))).sum(1)
    return per_row.mean() * temperature**2


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_kl_matches_manual_formula(shape: tuple[int, ...], temperature: float) -> None:
    s, t = _pair(shape, seed=2)
    expected = _manual_kl(s, t, temperature)
    torch.testing.assert_close(kl_div_loss(s, t, temperature=temperature), expected)
    torch.testing.assert_close(KLDivLoss(temperature=temperature)(s, t), expected)


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_kl_2d_matches_torch_kl_div_batchmean(temperature: float) -> None:
    s, t = _pair((5, 7), seed=3)
    expected = (
        F.kl_div(
            F.log_softmax(s / temperature, dim=1),
            F.softmax(t / temperature, dim=1),
            reduction="batchmean",
        )
        * temperature**2
    )
    torch.testing.assert_close(kl_div_loss(s, t, temperature), expected)


def test_kl_temperature_scaling() -> None:
    s, t = _pair((6, 10), seed=4)
    for temperature in (0.5, 2.0, 8.0):
        scaled = kl_div_loss(s, t, temperature=temperature)
        plain = kl_div_loss(s / temperature, t / temperature, temperature=1.0)
        torch.testing.assert_close(scaled, plain * temperature**2)
    # A higher temperature softens the targets: the unscaled divergence shrinks.
    high = kl_div_loss(s, t, temperature=8.0) / 64
    low = kl_div_loss(s, t, temperature=1.0)
    assert high < low


@pytest.mark.parametrize("shape", SHAPES)
def test_kl_classes_the_teacher_masks_add_nothing(shape: tuple[int, ...]) -> None:
    # a teacher logit of -inf (a masked vocabulary) made the loss NaN (0 * log 0 in F.kl_div),
    # also where the student masks the same class
    student, teacher = (t.double() for t in _pair(shape, seed=3))
    c = 2 if len(shape) == 3 else 1
    teacher.select(c, 0).fill_(-math.inf)
    both = student.clone()
    both.select(c, 0).fill_(-math.inf)
    p_t = F.softmax(_to_rows(teacher) / 2.0, dim=1)[:, 1:]
    for s in (student, both):
        log_s = F.log_softmax(_to_rows(s) / 2.0, dim=1)[:, 1:]
        expected = (p_t * (p_t.log() - log_s)).sum() / p_t.shape[0] * 4.0
        torch.testing.assert_close(kl_div_loss(s, teacher, temperature=2.0), expected)
    leaf = student.clone().requires_grad_()
    kl_div_loss(leaf, teacher).backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    # a NaN logit is not a masked class: the loss stays NaN
    teacher.select(c, 1).fill_(math.nan)
    assert kl_div_loss(student, teacher).isnan()


@pytest.mark.parametrize(("shape", "dim"), [((8, 1), 1), ((2, 1, 4, 4), 1), ((2, 5, 1), 2)])
def test_kl_of_one_class_is_refused_with_the_binary_form(shape: tuple[int, ...], dim: int) -> None:
    # one logit per sample (a binary classifier) gave a loss of 0 and no gradient without a word
    student, teacher = _pair(shape, seed=9)
    with pytest.raises(
        RecorderConfigError,
        match=rf"Expected kl_div_loss logits with at least 2 classes on dim {dim} but got shape "
        + re.escape(str(shape))
        + rf": a softmax over one class is 1 .*`torch\.cat\(\[torch\.zeros_like\(x\), x\], "
        rf"dim={dim}\)`",
    ):
        KLDivLoss(temperature=2.0)(student, teacher)
    # the form the message gives is the binary KL divergence of sigmoid(s / T) and sigmoid(t / T)
    s2, t2 = (torch.cat([torch.zeros_like(x), x], dim=dim).double() for x in (student, teacher))
    p_s, p_t = torch.sigmoid(student.double() / 2.0), torch.sigmoid(teacher.double() / 2.0)
    binary = p_t * (p_t / p_s).log() + (1 - p_t) * ((1 - p_t) / (1 - p_s)).log()
    torch.testing.assert_close(
        kl_div_loss(s2, t2, temperature=2.0), binary.mean() * 4.0, rtol=1e-10, atol=0
    )


def test_kl_explicit_dim() -> None:
    s, t = _pair((3, 4, 5), seed=5)  # classes on dim 1 this time
    expected = _manual_kl(s.transpose(1, 2), t.transpose(1, 2), 2.0)
    torch.testing.assert_close(kl_div_loss(s, t, temperature=2.0, dim=1), expected)


def test_mixed_dtypes_are_promoted() -> None:
    s = torch.randn(3, 4, dtype=torch.float32, requires_grad=True)
    t = torch.randn(3, 4, dtype=torch.float64)
    value = mse_loss(s, t)
    assert value.dtype == torch.float64
    torch.testing.assert_close(value, ((s.double() - t) ** 2).mean())
    value.backward()
    assert s.grad is not None and s.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("autocast", [False, True])
def test_half_precision_features_are_compared_in_float32(
    dtype: torch.dtype, autocast: bool
) -> None:
    # A student close to its teacher, as distillation makes it: the loss is a small difference
    # that half precision loses (a KL divergence of bfloat16 logits came out negative).
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(8, 16, 4, 4, generator=gen)
    s = base.to(dtype).requires_grad_(True)
    t = (base + 0.05 * torch.randn(8, 16, 4, 4, generator=gen)).to(dtype)
    s64, t64 = s.detach().double(), t.double()  # the very values the loss is given

    def maps(x: Tensor) -> Tensor:
        return F.normalize(x.pow(2).mean(1).flatten(1), dim=1)

    kl_s, kl_t = _to_rows(s64) / 4.0, _to_rows(t64) / 4.0
    expected = {
        "mse": ((s64 - t64) ** 2).mean(),
        "l1": (s64 - t64).abs().mean(),
        "cosine": (1 - F.cosine_similarity(s64, t64, dim=1)).mean(),
        "attention": ((maps(s64) - maps(t64)) ** 2).mean(),
        "kl": F.kl_div(
            kl_s.log_softmax(1), kl_t.log_softmax(1), reduction="batchmean", log_target=True
        )
        * 16.0,
    }
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        found = {
            name: get_loss(name, **({"temperature": 4.0} if name == "kl" else {}))(s, t)
            for name in expected
        }
    for name, value in found.items():
        assert value.dtype == torch.float32, name
        # float32 rounding (a few 1e-5 for the KL of close logits); half precision was 2 % off
        # (float16 cosine) to negative (the KL)
        torch.testing.assert_close(value.double(), expected[name], rtol=1e-3, atol=0, msg=name)
        value.backward()
    assert s.grad is not None and s.grad.dtype == dtype


def test_losses_work_in_inference_mode() -> None:
    s, t = _pair((2, 4, 3, 3))
    with torch.inference_mode():
        for name in ("mse", "l1", "cosine", "attention", "kl"):
            assert torch.isfinite(get_loss(name)(s, t))


# --------------------------------------------------------------------------- gradients

ALL_LOSSES: list[tuple[str, Callable[[Tensor, Tensor], Tensor]]] = [
    ("mse", mse_loss),
    ("l1", l1_loss),
    ("cosine", cosine_loss),
    ("attention", attention_transfer_loss),
    ("kl", functools.partial(kl_div_loss, temperature=3.0)),
]


GRAD_CASES = [
    (name, loss, shape)
    for name, loss in ALL_LOSSES
    for shape in SHAPES
    if not (name == "attention" and len(shape) == 2)  # attention needs positions
]


@pytest.mark.parametrize(("name", "loss", "shape"), GRAD_CASES)
def test_gradients_reach_student_and_never_teacher(
    name: str, loss: Callable[[Tensor, Tensor], Tensor], shape: tuple[int, ...]
) -> None:
    s0, t0 = _pair(shape, seed=6)
    student = s0.clone().requires_grad_(True)
    teacher = t0.clone().requires_grad_(True)
    value = loss(student, teacher)
    assert value.ndim == 0 and value.requires_grad
    value.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None


@pytest.mark.parametrize(("name", "loss", "shape"), GRAD_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_without_samples_gives_zero_with_a_zero_gradient(
    name: str, loss: Callable[[Tensor, Tensor], Tensor], shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    # a mean over no sample is NaN: one empty batch made the student's loss NaN
    empty = (0, *shape[1:])
    student = torch.zeros(empty, dtype=dtype, requires_grad=True)
    value = loss(student, torch.zeros(empty, dtype=dtype))
    assert value.ndim == 0 and value.dtype == torch.float32  # as for a batch with samples
    assert float(value) == 0.0  # exactly: a sum over nothing
    value.backward()
    assert student.grad is not None and student.grad.shape == empty
    # the shapes are still checked: an empty batch does not hide a mismatch (a position dim
    # differs, which attention transfer refuses too)
    other = list(empty)
    other[max(1, len(shape) - 2)] += 1
    with pytest.raises(RecorderConfigError, match="student"):
        loss(student, torch.zeros(other))


@pytest.mark.parametrize("name", ["mse", "l1", "cosine", "attention", "kl"])
def test_module_form_keeps_teacher_out_of_the_graph(name: str) -> None:
    student = torch.randn(2, 4, 3, 3, requires_grad=True)
    teacher_weight = nn.Parameter(torch.ones(()))
    teacher = torch.randn(2, 4, 3, 3) * teacher_weight
    get_loss(name)(student, teacher).backward()
    assert student.grad is not None
    assert teacher_weight.grad is None


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("loss", [mse_loss, l1_loss, cosine_loss, kl_div_loss])
def test_shape_mismatch_names_both_shapes(loss: Callable[[Tensor, Tensor], Tensor]) -> None:
    with pytest.raises(RecorderConfigError, match=r"student \(2, 8\) and teacher \(2, 16\)"):
        loss(torch.zeros(2, 8), torch.zeros(2, 16))


@pytest.mark.parametrize("loss", [mse_loss, l1_loss, cosine_loss, kl_div_loss])
def test_integer_and_bool_features_are_refused(loss: Callable[[Tensor, Tensor], Tensor]) -> None:
    # mse failed inside torch ("mse_cpu" not implemented for 'Bool'), kl took a mask as logits
    logits = torch.randn(4, 6)
    for student, teacher, side, dtype in (
        (logits > 0, logits < 0, "student", "bool"),
        (logits, logits.argsort(1), "teacher", "int64"),
    ):
        with pytest.raises(
            RecorderConfigError,
            match=rf"Expected the {side} features to have a floating-point dtype but got "
            rf"torch\.{dtype}: an integer or bool output \(an argmax, a mask\)",
        ):
            loss(student, teacher)


@pytest.mark.parametrize("loss", [mse_loss, cosine_loss, kl_div_loss])
def test_complex_features_are_refused_where_the_loss_has_no_complex_form(
    loss: Callable[[Tensor, Tensor], Tensor],
) -> None:
    # mse and kl failed inside torch (not implemented for 'ComplexFloat'), cosine with a
    # RuntimeError about the common dtype
    z = torch.randn(4, 6, dtype=torch.complex64)
    for student, teacher, side in ((z, z.real, "student"), (z.real, z, "teacher")):
        with pytest.raises(
            RecorderConfigError,
            match=rf"Expected real {side} features for {loss.__name__} but got "
            r"torch\.complex64: .*torch\.view_as_real",
        ):
            loss(student, teacher)


@pytest.mark.parametrize("loss", [l1_loss, attention_transfer_loss])
def test_complex_features_are_compared_by_magnitude(
    loss: Callable[[Tensor, Tensor], Tensor],
) -> None:
    z = torch.randn(2, 3, 4, 4, dtype=torch.complex128, requires_grad=True)
    w = torch.randn(2, 3, 4, 4, dtype=torch.complex128)
    value = loss(z, w)
    value.backward()
    assert value.dtype == torch.float64 and z.grad is not None


@pytest.mark.parametrize(
    "loss", [mse_loss, l1_loss, cosine_loss, kl_div_loss, attention_transfer_loss]
)
def test_features_on_two_devices_are_refused_naming_both(
    loss: Callable[[Tensor, Tensor], Tensor],
) -> None:
    # failed inside torch: "Tensor on device meta is not on the expected device cpu!"
    here, there = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4, device="meta")
    for student, teacher, s_dev, t_dev in (
        (here, there, "cpu", "meta"),
        (there, here, "meta", "cpu"),
    ):
        with pytest.raises(
            RecorderConfigError,
            match=rf"one device but got student on {s_dev} and teacher on {t_dev}; move the "
            r"teacher model to the student's device",
        ):
            loss(student, teacher)


def test_feature_shape_mismatch_suggests_a_connector() -> None:
    with pytest.raises(RecorderConfigError, match="build_connector"):
        mse_loss(torch.zeros(2, 8, 4, 4), torch.zeros(2, 16, 4, 4))


def test_attention_spatial_mismatch_names_both_shapes() -> None:
    with pytest.raises(
        RecorderConfigError, match=r"spatial size.*\(2, 8, 4, 4\) and teacher \(2, 3, 8, 8\)"
    ):
        attention_transfer_loss(torch.zeros(2, 8, 4, 4), torch.zeros(2, 3, 8, 8))
    with pytest.raises(RecorderConfigError, match=r"\(2, 5, 4\) and teacher \(2, 6, 4\)"):
        attention_transfer_loss(torch.zeros(2, 5, 4), torch.zeros(2, 6, 4))
    with pytest.raises(RecorderConfigError, match=r"\(2, 8, 4, 4\) and teacher \(3, 8, 4, 4\)"):
        attention_transfer_loss(torch.zeros(2, 8, 4, 4), torch.zeros(3, 8, 4, 4))


@pytest.mark.parametrize(
    ("s_shape", "t_shape"), [((4, 8, 1, 1), (4, 32, 1, 1)), ((4, 1, 16), (4, 1, 64))]
)
def test_attention_of_one_position_is_refused(
    s_shape: tuple[int, ...], t_shape: tuple[int, ...]
) -> None:
    # one position's normalised map is 1: pooled maps or one token gave 0 with no gradient,
    # without a word
    student, teacher = torch.randn(s_shape), torch.randn(t_shape)
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected attention transfer features with at least 2 positions per sample but "
        + re.escape(f"got student {s_shape} and teacher {t_shape}: the attention map of one")
        + r".*mse_loss or cosine_loss\.$",
    ):
        AttentionTransferLoss(distance="l2")(student, teacher)


def test_attention_rank_errors() -> None:
    with pytest.raises(RecorderConfigError, match=r"same rank.*\(2, 8\) and teacher \(2, 8\)"):
        attention_transfer_loss(torch.zeros(2, 8), torch.zeros(2, 8))
    with pytest.raises(RecorderConfigError, match=r"\(2, 8, 4\) and teacher \(2, 8, 4, 1\)"):
        attention_transfer_loss(torch.zeros(2, 8, 4), torch.zeros(2, 8, 4, 1))


def test_one_dimensional_features_are_rejected() -> None:
    with pytest.raises(RecorderConfigError, match=r"cosine_loss.*2-D or more.*\(5,\)"):
        cosine_loss(torch.zeros(5), torch.zeros(5))
    with pytest.raises(RecorderConfigError, match=r"kl_div_loss.*\(5,\)"):
        kl_div_loss(torch.zeros(5), torch.zeros(5))


def test_dim_out_of_range() -> None:
    with pytest.raises(RecorderConfigError, match=r"Expected `dim` to be in \[-2, 1\].*but got 2"):
        cosine_loss(torch.zeros(2, 3), torch.zeros(2, 3), dim=2)


def test_non_tensor_inputs() -> None:
    with pytest.raises(
        RecorderConfigError, match=r"Expected `student` to be a torch\.Tensor but got list"
    ):
        mse_loss([1.0], torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(
        RecorderConfigError, match=r"Expected `teacher` to be a torch\.Tensor but got float"
    ):
        kl_div_loss(torch.zeros(1, 2), 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "2", True])
def test_temperature_must_be_positive(bad: object) -> None:
    with pytest.raises(RecorderConfigError, match="Expected `temperature` to be a positive number"):
        KLDivLoss(temperature=bad)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match="Expected `temperature` to be a positive number"):
        kl_div_loss(torch.zeros(1, 2), torch.zeros(1, 2), temperature=bad)  # type: ignore[arg-type]


def test_attention_options_are_checked() -> None:
    with pytest.raises(
        RecorderConfigError, match=r"Expected `p` to be a positive number but got 0"
    ):
        AttentionTransferLoss(p=0)
    with pytest.raises(RecorderConfigError, match=r"Expected `distance` to be one of 'mse', 'l2'"):
        AttentionTransferLoss(distance="l3")  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `distance`.*but got 'cos'"):
        attention_transfer_loss(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), distance="cos")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- resolver


@pytest.mark.parametrize(
    ("spec", "cls"),
    [
        ("mse", MSELoss),
        ("MSE", MSELoss),
        ("l2", MSELoss),
        ("MSELoss", MSELoss),
        ("fitnets", MSELoss),
        ("l1", L1Loss),
        ("mae", L1Loss),
        ("L1_loss", L1Loss),
        ("cosine", CosineLoss),
        ("cos", CosineLoss),
        ("attention", AttentionTransferLoss),
        ("AT", AttentionTransferLoss),
        ("attention-transfer", AttentionTransferLoss),
        ("AttentionTransferLoss", AttentionTransferLoss),
        ("kl", KLDivLoss),
        ("KL_Div", KLDivLoss),
        ("kd", KLDivLoss),
        (" KLDivLoss ", KLDivLoss),
    ],
)
def test_get_loss_names_and_aliases(spec: str, cls: type[nn.Module]) -> None:
    assert type(get_loss(spec)) is cls


def test_get_loss_options() -> None:
    loss = get_loss("kl", temperature=4.0)
    assert isinstance(loss, KLDivLoss) and loss.temperature == 4.0
    s, t = _pair((3, 5))
    torch.testing.assert_close(loss(s, t), kl_div_loss(s, t, temperature=4.0))
    at = get_loss("attention", p=1.0, distance="l2")
    assert isinstance(at, AttentionTransferLoss) and (at.p, at.distance) == (1.0, "l2")


def test_get_loss_unknown_option() -> None:
    with pytest.raises(
        RecorderConfigError,
        match=r"options of the 'kl' loss to be among 'temperature', 'dim' but got 'temprature'"
        r".*Closest options: 'temperature'",
    ):
        get_loss("kl", temprature=2.0)
    with pytest.raises(
        RecorderConfigError, match=r"Expected no options for the 'mse' loss but got 'x'"
    ):
        get_loss("mse", x=1)


def test_get_loss_invalid_option_value() -> None:
    with pytest.raises(RecorderConfigError, match="Expected `temperature` to be a positive number"):
        get_loss("kl", temperature=-1.0)


@pytest.mark.parametrize(
    ("spec", "closest"), [("msee", "mse"), ("attentoin", "attention"), ("cosin", "cosine")]
)
def test_get_loss_unknown_name_suggests_closest(spec: str, closest: str) -> None:
    # The one unknown-type error of every registry (recorders, deliveries, losses).
    with pytest.raises(
        UnknownRecorderTypeError,
        match=rf"Unknown loss type '{spec}' in `loss`.*Closest types: '{closest}'.*"
        r"Valid loss types: attention, cosine, kl, l1, mse\.",
    ):
        get_loss(spec)


def test_get_loss_module_used_as_is() -> None:
    module = nn.SmoothL1Loss()
    assert get_loss(module) is module
    with pytest.raises(
        RecorderConfigError, match=r"Expected no options with an nn.Module loss.*'beta'"
    ):
        get_loss(module, beta=2.0)


def test_get_loss_module_class_is_instantiated() -> None:
    loss = get_loss(nn.SmoothL1Loss, beta=0.5)
    assert isinstance(loss, nn.SmoothL1Loss) and loss.beta == 0.5
    assert isinstance(get_loss(KLDivLoss, temperature=2.0), KLDivLoss)
    with pytest.raises(
        RecorderConfigError, match=r"Expected the options of KLDivLoss.*'temperatur'"
    ):
        get_loss(KLDivLoss, temperatur=2.0)
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected a loss class to subclass torch\.nn\.Module but got dict",
    ):
        get_loss(dict)  # type: ignore[arg-type]


def test_get_loss_user_callable() -> None:
    def max_error(student: Tensor, teacher: Tensor, scale: float = 1.0) -> Tensor:
        return (student - teacher).abs().max() * scale

    assert get_loss(max_error) is max_error
    bound = get_loss(max_error, scale=3.0)
    assert float(bound(torch.zeros(2), torch.tensor([1.0, -2.0]))) == 6.0
    with pytest.raises(RecorderConfigError, match=r"options of max_error.*but got 'scal'.*'scale'"):
        get_loss(max_error, scal=3.0)


@pytest.mark.parametrize("spec", [42, None, 1.5])
def test_get_loss_bad_type(spec: object) -> None:
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected the loss to be a name, an nn\.Module or a callable.*but got "
        + type(spec).__name__,
    ):
        get_loss(spec)  # type: ignore[arg-type]


def test_module_reprs_show_options() -> None:
    assert repr(KLDivLoss(temperature=3.0, dim=-1)) == "KLDivLoss(temperature=3.0, dim=-1)"
    assert repr(AttentionTransferLoss()) == "AttentionTransferLoss(p=2.0, distance='mse')"
    assert repr(CosineLoss(dim=2)) == "CosineLoss(dim=2)"


# --------------------------------------------------------------------------- properties

_logits = st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=6, max_size=6)


@settings(max_examples=30, deadline=None)
@given(_logits, _logits, st.floats(0.1, 10.0), st.floats(-50, 50))
def test_kl_properties(s: list[float], t: list[float], temperature: float, shift: float) -> None:
    student = torch.tensor(s, dtype=torch.float64).view(2, 3)
    teacher = torch.tensor(t, dtype=torch.float64).view(2, 3)
    value = kl_div_loss(student, teacher, temperature)
    assert value >= -1e-9
    assert abs(float(kl_div_loss(teacher, teacher, temperature))) < 1e-9
    torch.testing.assert_close(kl_div_loss(student + shift, teacher, temperature), value)


_positive = st.floats(0.01, 100.0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), _positive, _positive)
def test_scale_invariance(seed: int, a: float, b: float) -> None:
    s, t = _pair((2, 3, 2, 2), seed=seed)
    s, t = s.double(), t.double()
    torch.testing.assert_close(cosine_loss(s * a, t * b), cosine_loss(s, t))
    torch.testing.assert_close(attention_transfer_loss(s * a, t * b), attention_transfer_loss(s, t))
    assert 0.0 <= float(cosine_loss(s, t)) <= 2.0


def test_shape_error_names_a_connector_function_that_exists() -> None:
    with pytest.raises(RecorderConfigError, match="same shape") as info:
        mse_loss(torch.zeros(2, 3), torch.zeros(2, 4))
    (named,) = re.findall(r"`(lightning_recorder\.[\w.]+)`", str(info.value))
    assert pydoc.locate(named) is build_connector
