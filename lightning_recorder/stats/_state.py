"""The one definition of the statistics: a packed state per stream, its merge and its results.

**Packed state.** The statistics of a stream of tensors travel as one ``float64`` vector of
:data:`WIDTH` numbers: the count, mean and sum of squared deviations (``M2``) of the finite
elements, their min, max and sum of ``|x|``, the number of zeros, of NaN, of ``+inf``, of
``-inf`` and of all elements (:data:`COUNT` … :data:`NUMEL`). States stack along any leading
dimensions (``(m, WIDTH)`` for ``m`` streams) and merge with Chan's parallel formula
(:func:`merge`), so one gather carries every stream of a step across ranks.

**One pass.** :func:`rows_state` computes the states of the rows of a 2-d tensor in one read of
the data: every value is converted to ``float64`` as it is read (nothing is copied to
``float64`` first when it runs compiled) and the sums are taken of the deviations from a
*shift*, the mean of a few finite values spread over the row, so ``M2 = sum(d**2) -
sum(d)**2 / n`` cancels little (:func:`state_from_sums`). It is plain torch: the engine
(:mod:`._engine`) runs the same function compiled by ``torch.compile`` where it can (inductor
on the CPU, Triton on CUDA) and eagerly elsewhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "ABS_SUM",
    "COUNT",
    "F64",
    "M2",
    "MAX",
    "MEAN",
    "MIN",
    "NAN",
    "NEGINF",
    "NUMEL",
    "POSINF",
    "WIDTH",
    "ZEROS",
    "empty_states",
    "finalize",
    "merge",
    "rows_state",
    "zeros_state",
]

# Layout of the packed state: one float64 vector, so that a rank's states travel in one gather.
COUNT, MEAN, M2, MIN, MAX, ABS_SUM, ZEROS, NAN, POSINF, NEGINF, NUMEL = range(11)
WIDTH = 11
F64 = torch.float64

# The shift of a row is the mean of the finite values among about this many of its elements,
# spread evenly over the row.
SHIFT_SAMPLE = 64


def empty_states(*shape: int, device: torch.device | str | None = None) -> Tensor:
    """The packed states of no data, shaped ``(*shape, WIDTH)``, filled on the device (no copy
    from the host: on CUDA that would synchronise)."""
    states = torch.zeros(*shape, WIDTH, dtype=F64, device=device)
    states.select(-1, MIN).fill_(math.inf)
    states.select(-1, MAX).fill_(-math.inf)
    return states


def zeros_state(count: int, device: torch.device | str | None = None) -> Tensor:
    """The packed state ``(WIDTH,)`` of ``count`` (> 0) elements equal to 0: the implicit
    elements of a sparse tensor."""
    state = empty_states(device=device)
    state[[COUNT, ZEROS, NUMEL]] = float(count)
    state[[MIN, MAX]] = 0.0
    return state


def rows_state(x: Tensor, finite: bool = False) -> Tensor:
    """The packed states ``(R, WIDTH)`` of the rows of ``x`` ``(R, L)``, of any real dtype.

    Every sum is taken in ``float64``. NaN and infinities are counted apart and left out of the
    other statistics; ``finite=True`` promises that there are none and skips that masking (a
    NaN or an infinity then shows in the sums, which the caller checks).
    """
    v = x.to(F64)
    length = v.shape[1]
    step = max(length // SHIFT_SAMPLE, 1)
    spread = v[:, ::step]
    if finite:
        shift = spread.mean(1)
        d = v - shift[:, None]
        count = torch.full_like(shift, length)
        none = torch.zeros_like(shift)
        return state_from_sums(
            count,
            shift,
            d.sum(1),
            (d * d).sum(1),
            v.abs().sum(1),
            v.amin(1),
            v.amax(1),
            (v == 0).sum(1, dtype=F64),
            none,
            none,
            none,
            count,
        )
    ok = (v == v) & (v.abs() != math.inf)
    seen = ok[:, ::step]
    shift = torch.where(seen, spread, 0.0).sum(1) / seen.sum(1).clamp(min=1)
    d = torch.where(ok, v - shift[:, None], 0.0)
    count = ok.sum(1, dtype=F64)
    nan = (v != v).sum(1, dtype=F64)
    posinf = (v == math.inf).sum(1, dtype=F64)
    neginf = (v == -math.inf).sum(1, dtype=F64)
    return state_from_sums(
        count,
        shift,
        d.sum(1),
        (d * d).sum(1),
        torch.where(ok, v.abs(), 0.0).sum(1),
        torch.where(ok, v, math.inf).amin(1),
        torch.where(ok, v, -math.inf).amax(1),
        (v == 0).sum(1, dtype=F64),
        nan,
        posinf,
        neginf,
        # every element is finite, NaN or infinite: the length, from the counts (compiled, in
        # the same kernel as they; a column filled apart would be a kernel of its own)
        count + nan + posinf + neginf,
    )


def state_from_sums(
    count: Tensor,
    shift: Tensor,
    total: Tensor,
    squares: Tensor,
    abs_sum: Tensor,
    low: Tensor,
    high: Tensor,
    zeros: Tensor,
    nan: Tensor,
    posinf: Tensor,
    neginf: Tensor,
    numel: Tensor,
) -> Tensor:
    """Packed states from the sums of the deviations ``d = x - shift`` of the finite values:
    ``mean = shift + sum(d) / n`` and ``M2 = sum(d**2) - sum(d)**2 / n`` (at least 0)."""
    n = count.clamp(min=1)
    seen = count > 0
    mean = torch.where(seen, shift + total / n, 0.0)
    m2 = torch.where(seen, (squares - total * (total / n)).clamp(min=0), 0.0)
    return torch.stack([count, mean, m2, low, high, abs_sum, zeros, nan, posinf, neginf, numel], -1)


def merge(states: Tensor, dim: int = 0) -> Tensor:
    """Merge packed states along ``dim`` (Chan et al.'s pairwise formula, n-way).

    ``states`` has the shape ``(..., WIDTH)``; the result drops ``dim``.
    """
    dim = dim % (states.dim() - 1)  # a dimension of the states, never the layout's
    count = states[..., COUNT]
    total = count.sum(dim)
    weight = count / total.unsqueeze(dim).clamp(min=1.0)
    mean = (weight * states[..., MEAN]).sum(dim)
    spread = count * (states[..., MEAN] - mean.unsqueeze(dim)).square()
    m2 = (states[..., M2] + spread).sum(dim)
    # The extremes as one reduction and the sums (ABS_SUM … NUMEL, adjacent) as another:
    # compiled, each reduction is a kernel, and one per column took nine launches on CUDA.
    low_high = torch.stack([states[..., MIN], -states[..., MAX]], -1).amin(dim)
    sums = states[..., ABS_SUM:].sum(dim)
    return torch.cat(
        [torch.stack([total, mean, m2, low_high[..., 0], -low_high[..., 1]], -1), sums], -1
    )


def finalize(states: Tensor, correction: int) -> dict[str, Tensor]:
    """The statistics of packed states ``(..., WIDTH)``, as ``float64`` tensors of shape ``...``.

    The definitions are those of :mod:`lightning_recorder.stats`.
    """
    count, numel = states[..., COUNT], states[..., NUMEL]
    nan = torch.full((), math.nan, dtype=F64, device=states.device)
    seen = count > 0
    dof = count - correction
    return {
        "mean": torch.where(seen, states[..., MEAN], nan),
        "std": torch.where(dof > 0, (states[..., M2] / dof.clamp(min=1.0)).sqrt(), nan),
        "min": torch.where(seen, states[..., MIN], nan),
        "max": torch.where(seen, states[..., MAX], nan),
        "abs_mean": torch.where(seen, states[..., ABS_SUM] / count.clamp(min=1.0), nan),
        "zero_fraction": torch.where(numel > 0, states[..., ZEROS] / numel.clamp(min=1.0), nan),
        "nonfinite": states[..., NAN] + states[..., POSINF] + states[..., NEGINF],
        "numel": numel.clone(),
    }
