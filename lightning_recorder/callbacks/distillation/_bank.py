"""The connectors of a :class:`~lightning_recorder.FeatureDistillation`: built, trained, saved.

Connectors live outside the student (so the student's checkpoint loads into a fresh student with
``strict=True``) and outside any DDP wrapper. This bank therefore does by hand what Lightning
and DDP would otherwise do for a submodule:

* build each connector when the first pair of features shows its shapes, without disturbing
  the training random stream, identically on every rank (broadcast from rank 0);
* train it with the user's optimizer: one extra parameter group, hyperparameters copied from
  the first group, learning-rate schedulers extended to it;
* average its gradients across ranks before each optimizer step;
* save weights and optimizer state in the callback's state, and keep the extra group out of
  the checkpoint's ``optimizer_states`` so they match what ``configure_optimizers`` creates.

The group is kept out of ``optimizer_states`` by taking it out of the optimizer while the
strategy collects the optimizer states (:meth:`ConnectorBank.hide`, from the callback's
``state_dict``, which Lightning calls just before, to ``on_save_checkpoint``, just after):
FSDP2 strategies (``ModelParallelStrategy``) key optimizer states by the model's parameter
names, and a parameter outside the model cannot be named.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from ..._core.compat import distributed_active
from ...distill.connectors import ConnectorSpec, is_auto, position_connector, resolve_connector
from ...distill.losses import default_channel_dim
from ...errors import RecorderConfigError


def _cast_state(value: Any, key: str, param: Tensor, group: Mapping[str, Any]) -> Any:
    """Bring one saved optimizer state value to ``param``'s device, as torch's loader does."""
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point() and value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


class ConnectorBank:
    """The connectors of every pair, their optimizer group and their saved state.

    Args:
        specs: the connector specification of each pair (see :func:`resolve_connector`).
        resize: interpolate student maps to the teacher's size in automatic connectors.
        lr: learning rate of the connectors' group (default: the first group's).
        roles: what the loss of each pair asks of its automatic connector (see
            :func:`connector_role`): ``"attention"`` gets one without parameters, ``"logits"``
            and ``"cross_entropy"`` of different class counts get none (an error).
        labels: the teacher side of each pair, as messages name it.
    """

    def __init__(
        self,
        specs: Mapping[str, ConnectorSpec],
        resize: bool,
        lr: float | None,
        roles: Mapping[str, tuple[str, int | None] | None] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.specs = dict(specs)
        self.roles = {pair: role for pair, role in (roles or {}).items() if role is not None}
        self.labels = dict(labels or {})
        self.resize = resize
        self.lr = lr
        self.modules: dict[str, nn.Module] = {}
        self.shapes: dict[str, tuple[list[int], list[int]]] = {}
        self._optimizer: Optimizer | None = None
        self._schedulers: list[Any] = []
        self._pending: dict[str, Any] | None = None
        #: Pairs whose connector holds weights restored from a checkpoint (in this fit).
        self.restored: set[str] = set()
        #: Pairs whose connector was built before this fit (an earlier fit or validation).
        self.earlier: set[str] = set()
        # The group taken out of the optimizer by hide(): (index, group, optimizer states).
        self._hidden: tuple[int, dict[str, Any], dict[Tensor, Any]] | None = None
        # The student of the latest fit or validation (weakly; None: not known).
        self._student: weakref.ReferenceType[nn.Module] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A weak reference does not pickle; a copy (ddp_spawn's) meets a copy of the student.
        return {**self.__dict__, "_student": None}

    def serve(self, student: nn.Module) -> list[str]:
        """Make ``student`` the one the connectors are trained with; return the pairs whose
        connectors (those with parameters) were built with another student, in an earlier fit
        or validation, and are kept for this one (a loaded checkpoint state replaces them)."""
        known, self._student = self._student, weakref.ref(student)
        if known is None or known() is student or self._pending is not None:
            return []
        return [p for p, m in self.modules.items() if next(m.parameters(), None) is not None]

    # ------------------------------------------------------------------ building
    def get(self, pair: str, student: Tensor, teacher: Tensor) -> nn.Module:
        """The connector of ``pair``, built from these features the first time."""
        module = self.modules.get(pair)
        if module is not None:
            return module
        # In the student's precision, as resolve_connector decides (not under autocast).
        device = student.device
        dtype = student.dtype if student.is_floating_point() else None
        with torch.inference_mode(False), torch.no_grad():
            self._build(pair, list(student.shape), list(teacher.shape), device, dtype)
            if distributed_active():
                for tensor in self._tensors(self.modules[pair]):
                    dist.broadcast(tensor, src=0)
        try:
            self.attach()
        except RecorderConfigError:  # an optimizer that cannot train it: no connector kept
            del self.modules[pair], self.shapes[pair]
            raise
        return self.modules[pair]

    def _build(
        self,
        pair: str,
        s_shape: list[int],
        t_shape: list[int],
        device: Any,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Build from full shapes (batch dim first); only the other dims are kept. ``dtype``:
        the student features' (see :func:`resolve_connector`), else the default."""
        # A forked random stream: building a connector does not change the training's randomness.
        with torch.random.fork_rng(devices=[]):
            example_s = torch.empty(s_shape, device=device, dtype=dtype)
            example_t = torch.empty(t_shape, device=device)
            module = self._resolve(pair, example_s, example_t)
        pending = (self._pending or {}).get("pairs", {}).get(pair)
        if pending is not None and pending["weights"]:
            try:
                module.load_state_dict(pending["weights"])
            except RuntimeError as err:  # another connector than the checkpoint's
                saved = ", ".join(f"{k} {list(v.shape)}" for k, v in pending["weights"].items())
                why = " ".join(str(err).split()).rstrip(". ")
                hint = ""
                if is_auto(self.specs[pair]) and self._role(pair) == "attention":
                    factory = (
                        "functools.partial(lightning_recorder.build_connector, resize=True)"
                        if self.resize
                        else "lightning_recorder.build_connector"
                    )
                    hint = (
                        " The automatic connector of an attention transfer pair has no "
                        "parameters (earlier versions learned one, which the loss does not "
                        f"need): to resume with the learned one, give this pair `{factory}` as "
                        "its connector factory."
                    )
                raise RecorderConfigError(
                    f"Expected the connector of pair {pair!r} to take the weights saved in the "
                    f"checkpoint's FeatureDistillation state ({saved}) but the "
                    f"{type(module).__name__} built from this run's `connectors` does not "
                    f"({why}). Resume with the `connectors` of the run that saved the "
                    "checkpoint, or start a new fit (without `ckpt_path`) to train a new "
                    f"connector.{hint}"
                ) from err
        self.modules[pair] = module
        self.shapes[pair] = (s_shape[1:], t_shape[1:])

    def _role(self, pair: str) -> str | None:
        role = self.roles.get(pair)
        return None if role is None else role[0]

    def _resolve(self, pair: str, student: Tensor, teacher: Tensor) -> nn.Module:
        """The connector of ``pair`` for these example features (see :func:`resolve_connector`).
        Attention transfer compares maps of any channel counts: its automatic connector has
        no parameters (an identity, or the resize of ``resize=True``). Logits of different
        class counts get no automatic connector: a KL divergence (or cross-entropy) between a
        learned projection of the student's classes and the teacher's is rarely what is meant."""
        spec, role = self.specs[pair], self.roles.get(pair)
        if is_auto(spec) and role is not None:
            kind, dim = role
            if kind == "attention":
                return position_connector(student.shape, teacher.shape, resize=self.resize)
            self._check_classes(pair, student.shape, teacher.shape, dim, kind)  # logits
        return resolve_connector(spec, student, teacher, resize=self.resize)

    def _check_classes(
        self,
        pair: str,
        s_shape: torch.Size,
        t_shape: torch.Size,
        dim: int | None,
        kind: str = "logits",
    ) -> None:
        """Raise unless the logits of ``pair`` have as many classes (on ``dim``) on both sides;
        shapes the KL divergence refuses anyway (other ranks, a ``dim`` out of range) are left
        to it and to :func:`build_connector`."""
        rank = len(s_shape)
        if rank != len(t_shape) or rank < 2:
            return
        d = default_channel_dim(rank) if dim is None else dim
        if not -rank <= d < rank or s_shape[d] == t_shape[d]:
            return
        c_s, c_t = s_shape[d], t_shape[d]
        what = "the cross-entropy" if kind == "cross_entropy" else "the KL divergence"
        raise RecorderConfigError(
            f"Expected the student and teacher logits of pair {pair!r} -> "
            f"{self.labels.get(pair, pair)!r} to have the same number of classes for {what} "
            f"but got {c_s} student classes and {c_t} teacher classes (dim {d % rank}): {what} "
            "compares two distributions over the same classes, "
            "and one between a learned projection of the student's logits and the teacher's "
            "is rarely what is meant, so connectors='auto' builds none. Pair logits over the "
            "same classes; or, if the mapping is deliberate, give this pair a connector of its "
            f"own: a module (torch.nn.Linear({c_s}, {c_t}) for (N, C) logits) or a factory "
            "(lightning_recorder.build_connector builds a learned linear layer or 1x1 "
            f"convolution), as connectors={{{pair!r}: ...}}."
        )

    @staticmethod
    def _tensors(module: nn.Module) -> Iterator[Tensor]:
        yield from (p.data for p in module.parameters())
        yield from module.buffers()

    def parameters(self) -> list[nn.Parameter]:
        """Every connector parameter, in pair order (the order of the optimizer group)."""
        seen: set[int] = set()
        params = []
        for pair in self.specs:
            module = self.modules.get(pair)
            for param in module.parameters() if module is not None else ():
                if id(param) not in seen and param.requires_grad:
                    seen.add(id(param))
                    params.append(param)
        return params

    # ------------------------------------------------------------------ the optimizer
    def bind(self, optimizer: Optimizer | None, schedulers: list[Any]) -> None:
        """Use ``optimizer`` (and extend ``schedulers``) for the connectors from now on (at the
        start of a fit: the connectors built so far are kept, as :attr:`earlier`)."""
        self.unhide()
        self.restored, self.earlier = set(), set(self.modules)  # restored again by a resume
        self._optimizer = optimizer
        self._schedulers = schedulers

    def restore(self, device: Any, student: nn.Module | None = None) -> None:
        """Build the connectors saved in a loaded state and attach them to the optimizer: in
        the dtype of ``student``'s floating-point parameters where they have one (that of its
        features, as a connector built from them: a checkpoint of a run in another precision
        is cast, as Lightning casts the student's weights), else in the dtype they were saved
        in."""
        pending = self._pending
        if pending is None:
            return
        found = {p.dtype for p in student.parameters() if p.is_floating_point()} if student else {}
        run_dtype = next(iter(found)) if len(found) == 1 else None
        with torch.inference_mode(False), torch.no_grad():
            for pair, saved in pending["pairs"].items():
                if pair in self.specs:
                    if pair in self.modules:
                        self.modules[pair].load_state_dict(saved["weights"])
                    else:
                        s_shape, t_shape = saved["student_shape"], saved["teacher_shape"]
                        dtypes = [w.dtype for w in saved["weights"].values()]
                        dtype = dtypes[0] if dtypes and dtypes[0].is_floating_point else None
                        dtype = run_dtype or dtype
                        self._build(pair, [1, *s_shape], [1, *t_shape], device, dtype)
                    self.restored.add(pair)
        self.attach()

    def _group_index(self) -> int | None:
        params = self.parameters()
        if self._optimizer is None or not params:
            return None
        for i, group in enumerate(self._optimizer.param_groups):
            if any(p is params[0] for p in group["params"]):
                return i
        return None

    def attach(self) -> None:
        """Give the optimizer a group holding every connector parameter not yet in it."""
        self.unhide()
        optimizer = self._optimizer
        params = self.parameters()
        if optimizer is None or not params:
            return
        index = self._group_index()
        if index is not None:
            group = optimizer.param_groups[index]
            known = {id(p) for p in group["params"]}
            group["params"].extend(p for p in params if id(p) not in known)
        else:
            if isinstance(optimizer, torch.optim.LBFGS):  # its step takes one group only
                pairs = [
                    pair
                    for pair, module in self.modules.items()
                    if any(p.requires_grad for p in module.parameters())
                ]
                raise RecorderConfigError(
                    f"Expected an optimizer that can train the connectors of pairs {pairs} "
                    "(an extra parameter group) but got LBFGS, which optimizes exactly one "
                    "parameter group. Give these pairs connectors without parameters "
                    "(connectors='identity' where the student's and the teacher's features "
                    "have the same shape, or a module of your own with no parameters), or "
                    "train with another optimizer."
                )
            first = optimizer.param_groups[0]
            group = {k: v for k, v in first.items() if k != "params"}
            if self.lr is not None:
                group["lr"] = group["initial_lr"] = self.lr
            group["params"] = params
            optimizer.add_param_group(group)
            self._extend_schedulers(len(optimizer.param_groups))
        self._load_pending_optimizer_state()

    def _extend_schedulers(self, n_groups: int) -> None:
        if self._optimizer is None:
            return
        group = self._optimizer.param_groups[-1]
        for scheduler in self._schedulers:
            base_lrs = getattr(scheduler, "base_lrs", None)
            if isinstance(base_lrs, list) and len(base_lrs) == n_groups - 1:
                base_lrs.append(group.get("initial_lr", group["lr"]))
            lambdas = getattr(scheduler, "lr_lambdas", None)
            if isinstance(lambdas, list) and len(lambdas) == n_groups - 1:
                lambdas.append(lambdas[0])
            # (`get_last_lr()` lists the new group from the scheduler's next `step()`, which
            # reads every group's lr: its private list is not written here)

    def _load_pending_optimizer_state(self) -> None:
        pending = self._pending
        index = self._group_index()
        if pending is None or index is None or self._optimizer is None:
            return
        saved = pending.get("optimizer")
        params = self.parameters()
        if saved is not None and len(saved["state"]) == len(params):
            group = self._optimizer.param_groups[index]
            group.update({k: v for k, v in saved["group"].items() if k != "params"})
            for param, state in zip(params, saved["state"], strict=True):
                if state:
                    self._optimizer.state[param] = {
                        k: _cast_state(v, k, param, group) for k, v in state.items()
                    }
        if all(pair in self.modules for pair in pending["pairs"] if pair in self.specs):
            self._pending = None

    def all_reduce_grads(self) -> None:
        """Average the connectors' gradients over the ranks (DDP does not see them). A
        connector without a gradient on every rank (a step a ``HealthMonitor`` skipped, a pair
        no rank called) keeps none, as in one process: the optimizer leaves it and its state
        alone."""
        if not distributed_active():
            return
        params = self.parameters()
        if not params:
            return
        missing = [param.grad is None for param in params]
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        # how many ranks have each gradient, reduced with them (read only where one is missing)
        have = torch.tensor([float(not m) for m in missing], device=grads[0].device)
        flat = torch.cat([*(g.reshape(-1) for g in grads), have.to(grads[0].dtype)])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        if any(missing):
            for param, found in zip(params, flat[offset:].tolist(), strict=True):
                if found == 0:
                    param.grad = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Shapes, weights and optimizer state of every built connector (tensors and lists)."""
        self.unhide()
        pairs = {
            pair: {
                "student_shape": list(self.shapes[pair][0]),
                "teacher_shape": list(self.shapes[pair][1]),
                "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            }
            for pair, module in self.modules.items()
        }
        state: dict[str, Any] = {"pairs": pairs, "optimizer": None}
        index = self._group_index()
        if index is not None and self._optimizer is not None:
            full = self._optimizer.state_dict()
            group = full["param_groups"][index]
            state["optimizer"] = {
                "group": {k: v for k, v in group.items() if k != "params"},
                "state": [full["state"].get(pid, {}) for pid in group["params"]],
            }
        elif self._pending is not None:  # loaded but not attached yet: keep what was loaded
            return self._pending
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep ``state``; it is applied when the connectors are built and attached."""
        self._pending = {"pairs": dict(state.get("pairs", {})), "optimizer": state.get("optimizer")}

    def hide(self) -> None:
        """Take the connectors' group (and its optimizer state) out of the optimizer.

        Between this call and :meth:`unhide` the optimizer holds exactly what
        ``configure_optimizers`` created, so any strategy can collect its state. Idempotent.
        """
        optimizer, index = self._optimizer, self._group_index()
        if self._hidden is not None or optimizer is None or index is None:
            return
        group = optimizer.param_groups.pop(index)
        states = {p: optimizer.state.pop(p) for p in group["params"] if p in optimizer.state}
        self._hidden = (index, group, states)

    def unhide(self) -> None:
        """Put back what :meth:`hide` took out, at the same place. Idempotent."""
        hidden, self._hidden = self._hidden, None
        if hidden is None or self._optimizer is None:
            return
        index, group, states = hidden
        self._optimizer.param_groups.insert(index, group)
        self._optimizer.state.update(states)
