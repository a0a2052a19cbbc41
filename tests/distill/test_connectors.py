"""Connectors: shapes, modules built, resizing, errors, determinism, training, resolution."""

from __future__ import annotations

import doctest
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_recorder.distill.connectors as connectors_module
from lightning_recorder import mse_loss
from lightning_recorder.distill.connectors import ConnectorSpec, build_connector, resolve_connector
from lightning_recorder.errors import RecorderConfigError


def test_docstring_examples_run() -> None:
    result = doctest.testmod(connectors_module)
    assert result.attempted >= 8
    assert result.failed == 0


def _params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())


# --------------------------------------------------------------------------- build_connector


def test_feature_maps_get_a_bias_free_1x1_conv() -> None:
    connector = build_connector((8, 16, 5, 5), (8, 32, 5, 5))
    assert isinstance(connector, nn.Conv2d)
    assert connector.kernel_size == (1, 1) and connector.bias is None
    assert (connector.in_channels, connector.out_channels) == (16, 32)
    out = connector(torch.randn(3, 16, 5, 5))  # another batch size
    assert out.shape == (3, 32, 5, 5)


def test_vectors_get_a_linear_layer() -> None:
    connector = build_connector(torch.Size([4, 10]), torch.Size([4, 24]))
    assert isinstance(connector, nn.Linear) and connector.bias is None
    assert connector(torch.randn(7, 10)).shape == (7, 24)


def test_tokens_get_a_linear_layer_on_the_last_dim() -> None:
    connector = build_connector([2, 9, 12], [2, 9, 20])
    assert isinstance(connector, nn.Linear)
    x = torch.randn(5, 9, 12)
    out = connector(x)
    assert out.shape == (5, 9, 20)
    torch.testing.assert_close(out, x @ connector.weight.T)


@pytest.mark.parametrize(
    ("s_shape", "t_shape"),
    [((4, 8), (2, 8)), ((4, 5, 8), (1, 5, 8)), ((4, 8, 3, 3), (6, 8, 3, 3))],
)
def test_identity_when_non_batch_dims_match(
    s_shape: tuple[int, ...], t_shape: tuple[int, ...]
) -> None:
    connector = build_connector(s_shape, t_shape, resize=True)
    assert isinstance(connector, nn.Identity)
    assert _params(connector) == []


@pytest.mark.parametrize(
    ("s_shape", "t_shape"),
    [
        ((2, 8), (2, 16)),
        ((2, 6, 8), (2, 6, 4)),
        ((2, 8, 4, 4), (2, 16, 4, 4)),
        ((2, 8, 16, 16), (2, 16, 8, 8)),
        ((2, 8, 4, 4), (2, 16, 8, 6)),
    ],
)
def test_output_matches_teacher_and_parameters_learn(
    s_shape: tuple[int, ...], t_shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    connector = build_connector(s_shape, t_shape, resize=True)
    params = _params(connector)
    assert params and all(p.requires_grad for p in params)
    student, teacher = torch.randn(s_shape), torch.randn(t_shape)
    assert connector(student).shape == teacher.shape
    optimizer = torch.optim.SGD(params, lr=0.5)
    first = float(mse_loss(connector(student), teacher).detach())
    for _ in range(20):
        optimizer.zero_grad()
        loss = mse_loss(connector(student), teacher)
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < first


@pytest.mark.parametrize(
    ("s_hw", "t_hw", "antialias"),
    [
        ((16, 16), (8, 8), True),
        ((16, 16), (5, 7), True),
        ((4, 6), (8, 8), False),
        ((16, 4), (8, 8), True),  # shrinks in H only: antialiased
    ],
)
def test_resize_only_interpolates_bilinearly_antialiased_when_shrinking(
    s_hw: tuple[int, int], t_hw: tuple[int, int], antialias: bool
) -> None:
    connector = build_connector((2, 8, *s_hw), (2, 8, *t_hw), resize=True)
    assert _params(connector) == []
    # the repr says how it resizes: bilinear, antialiased when it downsamples (decided per call)
    assert repr(connector) == (
        f"_Resize(size={t_hw}, mode='bilinear', align_corners=False, antialias='when downsampling')"
    )
    x = torch.randn(2, 8, *s_hw)
    expected = F.interpolate(
        x, size=t_hw, mode="bilinear", align_corners=False, antialias=antialias
    )
    torch.testing.assert_close(connector(x), expected, rtol=1e-6, atol=1e-6)


def test_downsampling_does_not_alias_a_checkerboard() -> None:
    # a checkerboard (the highest frequency a map holds) shrunk 16 -> 5: the aliased bilinear
    # result swings to +-0.64, the antialiased one stays within 0.002 of its mean, 0
    i = torch.arange(16)
    board = ((i[:, None] + i[None, :]) % 2 * 2 - 1).float().expand(2, 3, 16, 16)
    connector = build_connector(board.shape, (2, 3, 5, 5), resize=True)
    out = connector(board)
    aliased = F.interpolate(board, size=(5, 5), mode="bilinear", align_corners=False)
    assert float(aliased.abs().max()) > 0.5
    assert float(out.abs().max()) < 0.01
    expected = F.interpolate(board, size=(5, 5), mode="bilinear", antialias=True)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_antialiased_downsampling_of_half_precision_maps_on_the_cpu(dtype: torch.dtype) -> None:
    # torch's antialiased kernel has no half-precision CPU form: computed in float32, cast back
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16, 16)
    expected = F.interpolate(x, size=(6, 6), mode="bilinear", antialias=True)
    resize = build_connector(x.shape, (2, 4, 6, 6), resize=True)
    out = resize(x.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    # under CPU autocast (mixed precision) the connector stays float32, its input is bfloat16
    s = torch.randn(2, 4, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        connector = resolve_connector("auto", s, torch.randn(2, 8, 6, 6), resize=True)
        mapped = connector(s)
    assert connector.get_submodule("proj").weight.dtype == torch.float32
    assert mapped.shape == (2, 8, 6, 6)
    mapped.float().sum().backward()
    assert s.grad is not None and bool(torch.isfinite(s.grad).all())


@pytest.mark.parametrize(
    ("s_hw", "t_hw", "order"),
    [((16, 16), (8, 8), ["resize", "proj"]), ((4, 4), (8, 8), ["proj", "resize"])],
)
def test_resize_and_project_runs_the_conv_on_the_smaller_map(
    s_hw: tuple[int, int], t_hw: tuple[int, int], order: list[str]
) -> None:
    connector = build_connector((2, 8, *s_hw), (2, 16, *t_hw), resize=True)
    assert isinstance(connector, nn.Sequential)
    assert [name for name, _ in connector.named_children()] == order
    assert list(connector.state_dict()) == ["proj.weight"]
    conv = connector.get_submodule("proj")
    x = torch.randn(3, 8, *s_hw)
    shrinks = s_hw[0] > t_hw[0]
    expected = F.interpolate(
        conv(x), size=t_hw, mode="bilinear", align_corners=False, antialias=shrinks
    )
    torch.testing.assert_close(connector(x), expected)


def test_spatial_mismatch_without_resize_names_both_shapes() -> None:
    with pytest.raises(
        RecorderConfigError,
        match=r"same spatial size.*student \(2, 8, 16, 16\) and teacher \(2, 16, 8, 8\)"
        r".*`resize=True`",
    ):
        build_connector((2, 8, 16, 16), (2, 16, 8, 8))


def test_token_length_mismatch_is_an_error_even_with_resize() -> None:
    with pytest.raises(
        RecorderConfigError, match=r"same length L.*student \(2, 197, 8\) and teacher \(2, 50, 8\)"
    ):
        build_connector((2, 197, 8), (2, 50, 8), resize=True)


def test_rank_mismatch_names_both_shapes() -> None:
    with pytest.raises(
        RecorderConfigError, match=r"same rank but got student \(2, 8\) and teacher \(2, 8, 4, 4\)"
    ):
        build_connector((2, 8), (2, 8, 4, 4))


@pytest.mark.parametrize("shape", [(4,), (2, 3, 4, 5, 6)])
def test_unsupported_rank(shape: tuple[int, ...]) -> None:
    with pytest.raises(
        RecorderConfigError, match=rf"2-D \(N, C\), 3-D .* but got student \({shape[0]},"
    ):
        build_connector(shape, shape)


def test_bad_shape_arguments() -> None:
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected `student_shape` to be a sequence of ints such as `features\.shape` "
        r"but got Tensor",
    ):
        build_connector(torch.zeros(2, 3), (2, 3))  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"`teacher_shape` to hold .* but got \(2, 0\)"):
        build_connector((2, 3), (2, 0))
    with pytest.raises(
        RecorderConfigError, match=r"`teacher_shape` to hold .* but got \(2, 1\.5\)"
    ):
        build_connector((2, 3), (2, 1.5))  # type: ignore[arg-type]


def test_deterministic_given_the_seed() -> None:
    torch.manual_seed(123)
    first = build_connector((2, 8, 4, 4), (2, 16, 4, 4))
    torch.manual_seed(123)
    second = build_connector((2, 8, 4, 4), (2, 16, 4, 4))
    third = build_connector((2, 8, 4, 4), (2, 16, 4, 4))
    assert isinstance(first, nn.Conv2d) and isinstance(second, nn.Conv2d)
    assert isinstance(third, nn.Conv2d)
    torch.testing.assert_close(first.weight, second.weight)
    assert not torch.equal(second.weight, third.weight)


def test_state_dict_round_trip_between_connectors_built_from_the_same_shapes() -> None:
    shapes = ((2, 8, 8, 8), (2, 16, 4, 4))
    source = build_connector(*shapes, resize=True)
    target = build_connector(*shapes, resize=True)
    target.load_state_dict(source.state_dict(), strict=True)
    x = torch.randn(1, 8, 8, 8)
    torch.testing.assert_close(target(x), source(x))


def test_built_in_inference_mode_is_still_trainable() -> None:
    with torch.inference_mode():
        connector = build_connector((2, 4), (2, 6))
        via_resolve = resolve_connector("auto", torch.zeros(2, 4), torch.zeros(2, 6))
    for module in (connector, via_resolve):
        assert all(not p.is_inference() for p in module.parameters())
        loss = module(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        assert all(p.grad is not None for p in module.parameters())


# --------------------------------------------------------------------------- resolve_connector


@pytest.mark.parametrize("spec", [None, "auto", " AUTO "])
def test_resolve_auto_builds_from_the_examples(spec: ConnectorSpec) -> None:
    s, t = torch.randn(2, 8, 6, 6), torch.randn(2, 16, 3, 3)
    connector = resolve_connector(spec, s, t, resize=True)
    assert connector(s).shape == t.shape
    with pytest.raises(
        RecorderConfigError, match=r"student \(2, 8, 6, 6\) and teacher \(2, 16, 3, 3\)"
    ):
        resolve_connector(spec, s, t)


def test_resolve_identity() -> None:
    s, t = torch.randn(2, 8, 6, 6), torch.randn(2, 16, 6, 6)
    assert isinstance(resolve_connector("identity", s, t), nn.Identity)


def test_resolve_module_is_used_as_is() -> None:
    module = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16))
    s, t = torch.randn(2, 8, 6, 6), torch.randn(2, 16, 6, 6)
    assert resolve_connector(module, s, t) is module


def test_resolve_factory_gets_both_shapes() -> None:
    calls: list[tuple[torch.Size, torch.Size]] = []

    def factory(student_shape: torch.Size, teacher_shape: torch.Size) -> nn.Module:
        calls.append((student_shape, teacher_shape))
        return nn.Linear(student_shape[-1], teacher_shape[-1])

    s, t = torch.randn(3, 5, 4), torch.randn(3, 5, 7)
    connector = resolve_connector(factory, s, t)
    assert calls == [(torch.Size([3, 5, 4]), torch.Size([3, 5, 7]))]
    assert connector(s).shape == t.shape


def test_build_connector_is_a_factory() -> None:
    s, t = torch.randn(2, 8, 6, 6), torch.randn(2, 16, 3, 3)
    factory = functools.partial(build_connector, resize=True)
    assert resolve_connector(factory, s, t)(s).shape == t.shape


def test_resolve_factory_must_return_a_module() -> None:
    def factory(student_shape: torch.Size, teacher_shape: torch.Size) -> Tensor:
        return torch.zeros(1)

    with pytest.raises(
        RecorderConfigError,
        match=r"Expected the connector factory to return an nn\.Module but got Tensor",
    ):
        resolve_connector(factory, torch.zeros(1, 2), torch.zeros(1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [nn.Linear, nn.Conv2d])
def test_resolve_a_module_class_taking_sizes_names_the_factory_call(spec: type[nn.Module]) -> None:
    # a module class given as the connector failed inside torch at the first step ("empty():
    # argument 'size' must be tuple of ints, but found element of type torch.Size")
    name = spec.__name__
    with pytest.raises(
        RecorderConfigError,
        match=rf"Expected the connector factory {name} to build a module from the student and "
        rf"teacher feature shapes, called as {name}\(\(2, 8\), \(2, 16\)\), but it raised "
        r"TypeError: .*pass a module built for these shapes, or 'auto'\.$",
    ) as info:
        resolve_connector(spec, torch.zeros(2, 8), torch.zeros(2, 16))
    assert isinstance(info.value.__cause__, TypeError)
    # the errors of build_connector, as a factory, are its own
    with pytest.raises(
        RecorderConfigError, match=r"^Expected the student and teacher feature maps"
    ):
        resolve_connector(build_connector, torch.zeros(2, 8, 4, 4), torch.zeros(2, 16, 2, 2))


def test_resolve_unknown_name_suggests_closest() -> None:
    with pytest.raises(
        RecorderConfigError,
        match=r"one of 'auto', 'identity'.*but got 'identiy'\. Closest names: 'identity'",
    ):
        resolve_connector("identiy", torch.zeros(1, 2), torch.zeros(1, 2))  # type: ignore[arg-type]


def test_resolve_bad_spec_and_feature_types() -> None:
    with pytest.raises(
        RecorderConfigError, match=r"Expected the connector to be None.*but got int"
    ):
        resolve_connector(3, torch.zeros(1, 2), torch.zeros(1, 2))  # type: ignore[arg-type]
    with pytest.raises(
        RecorderConfigError, match=r"Expected `teacher_feature` to be a torch\.Tensor but got tuple"
    ):
        resolve_connector("auto", torch.zeros(1, 2), (1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("spec", ["auto", build_connector])
def test_resolve_connector_takes_the_dtype_of_the_student_features(
    dtype: torch.dtype, spec: ConnectorSpec
) -> None:
    s, t = torch.randn(2, 16, 4, 4, dtype=dtype), torch.randn(2, 32, 4, 4, dtype=dtype)
    connector = resolve_connector(spec, s, t)
    assert {p.dtype for p in connector.parameters()} == {dtype}
    assert connector(s).dtype == dtype  # the first call no longer fails inside torch
    given = nn.Linear(16, 32)  # a module given is used as it is
    assert resolve_connector(given, s, t).weight.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: the default dtype
        connector = resolve_connector(spec, s.bfloat16(), t)
        assert {p.dtype for p in connector.parameters()} == {torch.float32}
