"""``shape_of``: the shape every report of the package prints, nested tensors included."""

from __future__ import annotations

import pytest
import torch

from lightning_recorder._core.structures import shape_of


def test_a_dense_tensor_has_its_own_shape_as_ints() -> None:
    assert shape_of(torch.zeros(2, 3, 4)) == (2, 3, 4)
    assert shape_of(torch.tensor(1.0)) == ()
    assert shape_of(torch.zeros(0, 5)) == (0, 5)
    assert shape_of(torch.zeros(6, 4).to_sparse()) == (6, 4)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_a_nested_tensor_has_minus_one_where_its_components_differ(layout: torch.layout) -> None:
    parts = [torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(5, 4)]
    assert shape_of(torch.nested.nested_tensor(parts, layout=layout)) == (3, -1, 4)
    same = [torch.zeros(2, 4), torch.zeros(2, 4)]
    assert shape_of(torch.nested.nested_tensor(same, layout=layout)) == (2, 2, 4)
    assert all(type(d) is int for d in shape_of(torch.nested.nested_tensor(parts, layout=layout)))


def test_a_strided_nested_tensor_may_be_ragged_in_several_dimensions() -> None:
    parts = [torch.zeros(2, 4), torch.zeros(3, 5)]
    assert shape_of(torch.nested.nested_tensor(parts)) == (2, -1, -1)
    assert shape_of(torch.nested.nested_tensor([])) == (0,)
