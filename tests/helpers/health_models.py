"""Models, data and fault injection for the HealthMonitor tests (also used by the DDP script).

Four architectures, small enough that a step takes milliseconds: a CNN, a ResNet-style network
(BatchNorm followed by ``ReLU(inplace=True)``, residual blocks), an MLP and a transformer encoder
(``nn.TransformerEncoderLayer``: LayerNorm, multi-head attention under a causal mask of ``-inf``).

A :class:`Fault` makes one module produce a NaN, +inf or -inf on one step:

* ``forward`` — the module's forward (patched on the instance, so the value is made inside the
  module's call) returns its output with one element replaced;
* ``backward`` — the module's backward makes it: the forward hands its first input that needs a
  gradient through :class:`_Corrupt` (identity forward; backward replaces one element of the
  gradient), so the bad gradient is the module's share of its input's gradient; a module whose
  inputs need no gradient (the first layer) gets it in its first parameter's gradient instead
  (a gradient hook on the parameter).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

VALUES = {"nan": math.nan, "posinf": math.inf, "neginf": -math.inf}
MASK_PATTERNS = ("*.input.*mask",)  # the transformer's causal mask holds -inf on purpose


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU(inplace)-conv-BN, plus the (projected) input."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.down(x))


def resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 1, 1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        Block(8, 8),
        Block(8, 16, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 4),
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(),
        nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 4),
    )  # fmt: skip


class Encoder(nn.Module):
    """Token embedding, two pre-norm transformer layers under a causal mask, a head."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(6, dim)
        layer = nn.TransformerEncoderLayer(
            dim, 2, 32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        mask = torch.full((n, n), -math.inf, device=x.device).triu(1)
        h = self.encoder(self.embed(x), mask=mask)
        return self.head(self.norm(h)[:, -1])


class Trap(nn.Module):
    """The identity, except on a batch that carries the marker (a value above 100): NaN."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.where(x.abs().amax() > 100, math.nan, 1.0)


def trapped_mlp() -> nn.Module:
    return nn.Sequential(Trap(), mlp())


class Recip(nn.Module):
    """1/x: infinite where dropout zeroed its input."""

    def forward(self, x: Tensor) -> Tensor:
        return 1.0 / x


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.5), Recip(), nn.Linear(16, 4))


ARCHS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "cnn": (cnn, (3, 8, 8)),
    "resnet": (resnet, (3, 8, 8)),
    "mlp": (mlp, (12,)),
    "transformer": (Encoder, (5, 6)),
    "trapped": (trapped_mlp, (12,)),
    "dropout": (dropout_mlp, (12,)),
}


class Net(pl.LightningModule):
    """A classifier around one of :data:`ARCHS`; logs its loss with ``self.log``."""

    def __init__(self, arch: str, lr: float = 0.05, optimizer: str = "sgd") -> None:
        super().__init__()
        self.arch, self.lr, self.optimizer_name = arch, lr, optimizer
        self.body = ARCHS[arch][0]()
        self.logged: list[int] = []  # batch indices whose loss was logged

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss)
        self.logged.append(batch_idx)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


def data(
    arch: str, n: int, batch_size: int = 4, seed: int = 0, marked: tuple[int, ...] = ()
) -> DataLoader:
    """``n`` samples in order; the batches in ``marked`` carry :class:`Trap`'s marker."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *ARCHS[arch][1], generator=g)
    for batch in marked:
        x[batch * batch_size] = 1000.0
    y = torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class _Corrupt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, value: float, index: int) -> Tensor:
        ctx.value, ctx.index = value, index
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        grad.view(-1)[ctx.index % grad.numel()] = ctx.value
        return grad, None, None


def _first_grad_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any] | None:
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.requires_grad and a.is_floating_point():
            return ("args", i)
    for k, a in kwargs.items():
        if isinstance(a, Tensor) and a.requires_grad and a.is_floating_point():
            return ("kwargs", k)
    return None


def _replace_first(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, tuple):
        items = list(output)
        for i, item in enumerate(items):
            if isinstance(item, Tensor) and item.is_floating_point():
                items[i] = fn(item)
                return type(output)(items)
    raise TypeError(f"cannot inject into {type(output).__name__}")


@dataclass
class Fault:
    """One injected fault: ``module`` makes ``value`` in ``direction`` at optimizer ``step``."""

    module: str
    direction: str  # forward, backward
    value: str  # nan, posinf, neginf
    step: int
    index: int = 0

    def install(self, model: nn.Module) -> Callable[[], None]:
        """Install on ``model`` (a LightningModule); returns the function that removes it."""
        module = dict(model.named_modules())[self.module]
        value = VALUES[self.value]
        original = module.forward
        handles: list[Any] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.direction == "forward":

                def put(t: Tensor) -> Tensor:
                    flat = t.reshape(-1)
                    mask = torch.zeros_like(flat, dtype=torch.bool)
                    mask[self.index % flat.numel()] = True
                    return torch.where(mask, torch.full_like(flat, value), flat).reshape(t.shape)

                return _replace_first(original(*args, **kwargs), put)
            where = _first_grad_input(args, kwargs)
            if where is not None:
                kind, key = where
                if kind == "args":
                    args = tuple(
                        _Corrupt.apply(a, value, self.index) if i == key else a
                        for i, a in enumerate(args)
                    )
                else:
                    kwargs = {**kwargs, key: _Corrupt.apply(kwargs[key], value, self.index)}
            return original(*args, **kwargs)

        if self.direction == "backward" and not _takes_grad_input(model, self.module):
            param = next(module.parameters())

            def hook(grad: Tensor) -> Tensor:
                grad = grad.clone(memory_format=torch.contiguous_format)
                grad.view(-1)[self.index % grad.numel()] = value
                return grad

            handles.append(param.register_hook(hook))
        else:
            module.forward = forward  # type: ignore[method-assign]

        def remove() -> None:
            vars(module).pop("forward", None)
            for handle in handles:
                handle.remove()

        return remove


def _takes_grad_input(model: nn.Module, name: str) -> bool:
    """Whether the module's inputs need a gradient (all but the layers the batch goes into)."""
    return name not in FIRST_LAYERS.get(getattr(model, "arch", ""), ())


# The modules whose inputs need no gradient: the batch goes straight into them.
FIRST_LAYERS = {
    "cnn": ("body", "body.0"),
    "resnet": ("body", "body.0"),
    "mlp": ("body", "body.0"),
    "transformer": ("body", "body.embed"),
}


def called_modules(model: Net) -> list[str]:
    """The modules a forward of ``model`` calls, in the order they return."""
    seen: list[str] = []
    handles = [
        m.register_forward_hook(lambda *_, name=name: seen.append(name))
        for name, m in model.named_modules()
        if name
    ]
    try:
        x, _ = next(iter(data(model.arch, 2, 2)))
        model(x)
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(seen))


def candidates(model: Net, direction: str) -> list[str]:
    """The modules a fault can be injected into (backward: those that can make a gradient)."""
    names = []
    for name in called_modules(model):
        if name == "body":
            continue
        module = dict(model.named_modules())[name]
        no_params = not any(True for _ in module.parameters())
        if direction == "backward" and name in FIRST_LAYERS[model.arch] and no_params:
            continue
        names.append(name)
    return names


class Injector(pl.Callback):
    """Installs ``faults[step]`` for its step (from batch start to batch end)."""

    def __init__(self, faults: dict[int, Fault]) -> None:
        self.faults = faults
        self._remove: Callable[[], None] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        fault = self.faults.get(trainer.global_step)
        if fault is not None:
            self._remove = fault.install(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._clear()

    def on_exception(self, *args: Any) -> None:
        self._clear()

    def _clear(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None


class Truth(pl.Callback):
    """Which steps had a non-finite loss or gradient, by plain PyTorch (before the monitor)."""

    def __init__(self) -> None:
        self.bad: set[int] = set()
        self._loss_bad = False

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        self._loss_bad = not bool(torch.isfinite(loss).all())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if self._loss_bad or not all(bool(torch.isfinite(g).all()) for g in grads):
            self.bad.add(trainer.global_step)
