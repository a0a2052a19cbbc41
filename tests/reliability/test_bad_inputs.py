"""Every bad input a clear error: one table of bad calls over the whole public API.

Each case builds or calls something with one bad input and must raise the package's own error (a
:class:`~lightning_recorder.errors.RecorderError`; Python's ``TypeError`` only for an unknown
keyword argument) whose message names the argument and says what was expected. The call must also
leave nothing installed: the autouse fixture checks the package's hooks and patches, and the test
checks that no hook is left on the models the case built.

Cases the package does not handle yet stay in the table, marked ``xfail(strict=True)`` with a
reason starting with "pending:"; once fixed, the strict marker makes them fail until unmarked.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.distill_models import Student, Teacher
from helpers.distill_models import loader as distill_loader
from helpers.models import QUIET, ProbeNet, features
from helpers.models import loader as probe_loader
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

import lightning_recorder as lr
from lightning_recorder import bulk, graph, inspector, stats
from lightning_recorder.activations import ShardWriter
from lightning_recorder.errors import (
    DuplicateNameError,
    InvalidSourceError,
    NoRecordError,
    NotInitializedError,
    RecorderConfigError,
    RecorderError,
    RecorderStateError,
    UnknownRecorderTypeError,
    UnknownSourceError,
)

NAN, INF = float("nan"), float("inf")
CUDA = torch.cuda.is_available()

# --------------------------------------------------------------------------------- the models
# Every model a case builds is kept here, so the test can check that no hook is left on it.
MODELS: list[nn.Module] = []


class Net(nn.Module):
    """fc1 (4 -> 8), act, fc2 (8 -> 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def net(frozen: tuple[str, ...] = ()) -> Net:
    """A fresh :class:`Net`; the parameters named in ``frozen`` do not require grad."""
    model = Net()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    MODELS.append(model)
    return model


def probe_net(frozen: tuple[str, ...] = ()) -> ProbeNet:
    model = ProbeNet()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    MODELS.append(model)
    return model


def teacher() -> Teacher:
    model = Teacher()
    MODELS.append(model)
    return model


def student() -> Student:
    model = Student()
    MODELS.append(model)
    return model


X = torch.randn(3, 4)

# Files the cases write go under one folder, removed when the interpreter exits.
_SCRATCH = tempfile.TemporaryDirectory(prefix="bad_inputs_")


def scratch() -> str:
    """A new empty folder under the shared scratch folder."""
    return tempfile.mkdtemp(dir=_SCRATCH.name)


def hooks_left(model: nn.Module) -> list[str]:
    """Names of the hooks left on ``model``'s modules and parameters."""
    found = []
    for name, module in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            if getattr(module, attr, None):
                found.append(f"{name or '<root>'}.{attr}")
    for name, param in model.named_parameters():
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            if getattr(param, attr, None):
                found.append(f"{name}.{attr}")
    return found


# ------------------------------------------------------------------------------------ helpers
def init(recorder: Any, model: Any = None) -> None:
    """``recorder.initialize(model)``, released again whatever happens."""
    try:
        recorder.initialize(model)
    finally:
        recorder.release()


def init_delivery(delivery: lr.DistillDelivery) -> None:
    try:
        delivery.initialize()
    finally:
        delivery.release()


def recorded(recorder: lr.BaseRecorder, model: nn.Module | None = None) -> lr.BaseRecorder:
    """``recorder`` after one recorded forward of ``model`` (released; records stay readable)."""
    model = net() if model is None else model
    try:
        recorder.initialize(model)
        with recorder:
            model(X)
    finally:
        recorder.release()
    return recorder


def fit(
    callback: pl.Callback,
    model: pl.LightningModule | None = None,
    *,
    logger: bool = False,
    distill: bool = False,
    **trainer_kw: Any,
) -> None:
    """One training step of a tiny model with ``callback`` (``trainer_kw``: more Trainer
    arguments)."""
    if model is None:
        model = student() if distill else probe_net()
    data = distill_loader(8, 4) if distill else probe_loader(features(8))
    log: Any = False
    if logger:
        log = TensorBoardLogger(scratch(), name="", version="")
    trainer = pl.Trainer(
        **QUIET,
        devices=1,
        logger=log,
        max_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
        **trainer_kw,
    )
    trainer.fit(model, data)


def garbage_file(suffix: str = ".ckpt") -> str:
    path = Path(scratch()) / f"garbage{suffix}"
    path.write_bytes(b"this is not a checkpoint\x00\x01\x02")
    return str(path)


def collect(collector: Any, how: str = "children", model: nn.Module | None = None, **kw: Any):
    """Register ``collector`` over ``model`` (released again whatever happens)."""
    model = net() if model is None else model
    try:
        getattr(collector, how)(model, **kw)
    finally:
        collector.release()


def collected(collector: Any) -> Any:
    """``collector`` after registering on every child of a model and one forward (released)."""
    model = net()
    try:
        collector.children(model)
        with collector:
            model(X)
    finally:
        collector.release()
    return collector


def inspect_net(**kw: Any) -> inspector.Inspector:
    kw.setdefault("input_size", (1, 4))
    return inspector.Inspector(net(), **kw)


def with_inspector(action: Callable[[inspector.Inspector], Any]) -> Any:
    insp = inspect_net()
    try:
        return action(insp)
    finally:
        insp.release()


def a_graph() -> graph.ExecutionGraph:
    return graph.record_graph(net(), X)


def distill(**kw: Any) -> lr.FeatureDistillation:
    kw.setdefault("pairs", {"features.0": "features.0"})
    return lr.FeatureDistillation(kw.pop("teacher", None) or teacher(), **kw)


def t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# --------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[], Any]
    error: type[BaseException]
    match: str
    pending: str | None = None  # "pending: ..." reason while the package escapes this case


CASES: list[Case] = []


def case(
    id: str,
    build: Callable[[], Any],
    error: type[BaseException],
    match: str,
    pending: str | None = None,
) -> None:
    assert all(c.id != id for c in CASES), f"duplicate case id {id}"
    CASES.append(Case(id, build, error, match, pending))


# ----------------------------------------------------- shared recorder options, every recorder
RECORDERS: dict[str, tuple[type[lr.BaseRecorder], Any]] = {
    "ModuleOutputs": (lr.ModuleOutputsRecorder, "fc1"),
    "ModuleInputs": (lr.ModuleInputsRecorder, "fc1"),
    "ModuleOutputGrads": (lr.ModuleOutputGradsRecorder, "fc1"),
    "ModuleInputGrads": (lr.ModuleInputGradsRecorder, "fc1"),
    "Parameter": (lr.ParameterRecorder, "fc1.weight"),
    "ParameterGrad": (lr.ParameterGradRecorder, "fc1.weight"),
    "FunctionOutputs": (lr.FunctionOutputsRecorder, "helpers.toy.double"),
    "FunctionInputs": (lr.FunctionInputsRecorder, "helpers.toy.double"),
    "MethodOutputs": (lr.MethodOutputsRecorder, "helpers.toy.Toy.scale"),
    "MethodInputs": (lr.MethodInputsRecorder, "helpers.toy.Toy.scale"),
}

# (id suffix, options, error, match, pending) applied to every recorder class.
OPTION_CASES: list[tuple[str, dict[str, Any], type[BaseException], str, str | None]] = [
    ("keep-zero", {"keep": 0}, RecorderConfigError, r"`keep`.*positive int", None),
    ("keep-negative", {"keep": -2}, RecorderConfigError, r"`keep`.*positive int", None),
    ("keep-float", {"keep": 1.5}, RecorderConfigError, r"`keep`.*positive int", None),
    ("keep-unknown-name", {"keep": "latest"}, RecorderConfigError, r"`keep`.*'last'", None),
    ("keep-bool", {"keep": True}, RecorderConfigError, r"`keep`.*positive int", None),
    ("keep-none", {"keep": None}, RecorderConfigError, r"`keep`.*'all'", None),
    ("detach-str", {"detach": "yes"}, RecorderConfigError, r"`detach`.*bool", None),
    ("clone-int", {"clone": 1}, RecorderConfigError, r"`clone`.*bool", None),
    ("detach-none", {"detach": None}, RecorderConfigError, r"`detach`.*bool", None),
    ("device-gpu", {"device": "gpu"}, RecorderConfigError, r"`device`.*device string", None),
    ("device-int-list", {"device": [0]}, RecorderConfigError, r"`device`.*torch.device", None),
    (
        "dtype-int",
        {"dtype": 5},
        RecorderConfigError,
        r"`dtype`.*torch.dtype",
        None,
    ),
    ("dtype-unknown", {"dtype": "float17"}, RecorderConfigError, r"`dtype`.*torch.dtype", None),
    ("dtype-not-a-dtype", {"dtype": "Tensor"}, RecorderConfigError, r"`dtype`.*torch.dtype", None),
    ("path-empty-str", {"path": ""}, RecorderConfigError, r"`path`.*non-empty.*leave", None),
    ("path-empty-list", {"path": []}, RecorderConfigError, r"`path` to name at least one", None),
    ("path-empty-tuple", {"path": ()}, RecorderConfigError, r"`path`.*got \(\); leave", None),
    ("path-bytes", {"path": b"logits"}, RecorderConfigError, r"`path`.*int, a str", None),
    ("path-float", {"path": 1.5}, RecorderConfigError, r"`path`.*int, a str", None),
    ("path-none-item", {"path": [0, None]}, RecorderConfigError, r"`path`.*int or a str", None),
    ("unknown-kwarg", {"colour": "red"}, TypeError, r"unexpected keyword argument 'colour'", None),
]

for rec_name, (rec_cls, rec_source) in RECORDERS.items():
    for suffix, options, error, match, pending in OPTION_CASES:
        case(
            f"{rec_name}Recorder-{suffix}",
            lambda c=rec_cls, s=rec_source, o=options: c(s, **o),
            error,
            match,
            pending,
        )

for rec_name in ("ModuleOutputs", "FunctionOutputs", "Parameter"):
    rec_cls, rec_source = RECORDERS[rec_name]
    case(
        f"{rec_name}Recorder-device-cuda-without-cuda",
        lambda c=rec_cls, s=rec_source: c(s, device="cuda:0"),
        RecorderConfigError,
        r"`device`.*'cuda:0'.*(not available|no CUDA|available devices)",
        None,
    )

# ---------------------------------------------------------------------------- module sources
for rec_name in ("ModuleOutputs", "ModuleInputs", "ModuleOutputGrads", "ModuleInputGrads"):
    rec_cls = RECORDERS[rec_name][0]
    rid = f"{rec_name}Recorder"
    case(
        f"{rid}-source-none",
        lambda c=rec_cls: c(None),
        RecorderConfigError,
        r"`source`.*module name",
    )
    case(f"{rid}-source-int", lambda c=rec_cls: c(5), RecorderConfigError, r"`source`.*module name")
    case(
        f"{rid}-source-empty",
        lambda c=rec_cls: c(""),
        RecorderConfigError,
        r"`source`.*module name",
    )
    case(
        f"{rid}-source-unknown-name",
        lambda c=rec_cls: init(c("fc3"), net()),
        UnknownSourceError,
        r"'fc3'.*Closest module names:.*'fc1'",
    )
    case(
        f"{rid}-initialize-without-model",
        lambda c=rec_cls: init(c("fc1"), None),
        RecorderConfigError,
        r"`initialize\(model\)`.*nn.Module.*NoneType",
    )
    case(
        f"{rid}-initialize-int-model",
        lambda c=rec_cls: init(c("fc1"), 5),
        RecorderConfigError,
        r"`initialize\(model\)`.*nn.Module.*int",
    )

case(
    "ModuleOutputsRecorder-source-list",
    lambda: lr.ModuleOutputsRecorder(["fc1"]),
    RecorderConfigError,
    r"`source`.*module name",
)
case(
    "ModuleOutputsRecorder-source-empty-tuple",
    lambda: lr.ModuleOutputsRecorder(()),
    RecorderConfigError,
    r"`source`.*module (name|type)",
    None,
)
case(
    "ModuleOutputsRecorder-source-pattern-matches-nothing",
    lambda: init(lr.ModuleOutputsRecorder("conv*"), net()),
    UnknownSourceError,
    r"'conv\*' matches no module.*module names",
)
case(
    "ModuleOutputsRecorder-source-type-absent",
    lambda: init(lr.ModuleOutputsRecorder(nn.Conv2d), net()),
    UnknownSourceError,
    r"type Conv2d.*Types present: Linear, ReLU",
)
case(
    "ModuleOutputsRecorder-source-type-name-absent",
    lambda: init(lr.ModuleOutputsRecorder("Conv2d"), net()),
    UnknownSourceError,
    r"type Conv2d.*Types present: Linear, ReLU",
)
case(
    "ModuleOutputsRecorder-source-root",
    lambda: init(lr.ModuleOutputsRecorder("module"), net()),
    UnknownSourceError,
    r"'module'.*module names",
)
case(
    "ModuleInputsRecorder-path-unknown-argument",
    lambda: init(lr.ModuleInputsRecorder("fc1", path="nonexistent"), net()),
    RecorderConfigError,
    r"`path`.*'nonexistent'.*(argument|input)",
    None,
)
case(
    "ModuleInputGradsRecorder-path-unknown-argument",
    lambda: init(lr.ModuleInputGradsRecorder("fc1", path="nonexistent"), net()),
    RecorderConfigError,
    r"`path`.*'nonexistent'.*(argument|input)",
    None,
)
case(
    "ModuleInputGradsRecorder-path-two-items",
    lambda: lr.ModuleInputGradsRecorder("fc1", path=(0, 1)),
    RecorderConfigError,
    r"`path`.*name one argument",
)

# ------------------------------------------------------------------------- parameter sources
for rec_name in ("Parameter", "ParameterGrad"):
    rec_cls = RECORDERS[rec_name][0]
    rid = f"{rec_name}Recorder"
    case(
        f"{rid}-source-none",
        lambda c=rec_cls: c(None),
        RecorderConfigError,
        r"`source`.*parameter name",
    )
    case(
        f"{rid}-source-empty",
        lambda c=rec_cls: c(""),
        RecorderConfigError,
        r"`source`.*parameter name",
    )
    case(
        f"{rid}-source-type",
        lambda c=rec_cls: c(nn.Linear),
        RecorderConfigError,
        r"`source`.*parameter name",
    )
    case(
        f"{rid}-source-unknown-name",
        lambda c=rec_cls: init(c("fc1.wieght"), net()),
        UnknownSourceError,
        r"'fc1.wieght'.*Closest parameter names: 'fc1.weight'",
    )
    case(
        f"{rid}-source-pattern-matches-nothing",
        lambda c=rec_cls: init(c("*.scale"), net()),
        UnknownSourceError,
        r"'\*.scale' matches no parameter",
    )
    case(
        f"{rid}-initialize-without-model",
        lambda c=rec_cls: init(c("fc1.weight"), None),
        RecorderConfigError,
        r"`initialize\(model\)`.*nn.Module.*NoneType",
    )

case(
    "ParameterGradRecorder-frozen-parameter-named-exactly",
    lambda: init(lr.ParameterGradRecorder("fc1.weight"), net(frozen=("fc1.weight",))),
    RecorderConfigError,
    r"`source`.*'fc1.weight'.*(trainable.*frozen|frozen.*trainable)",
    None,
)
case(
    "ParameterGradRecorder-pattern-matches-only-frozen",
    lambda: init(lr.ParameterGradRecorder("fc1.*"), net(frozen=("fc1.weight", "fc1.bias"))),
    RecorderConfigError,
    r"`source`.*'fc1.\*'.*(trainable.*frozen|frozen.*trainable)",
    None,
)
case(
    "RecorderCallback-ParameterGrad-frozen-named-exactly-at-fit",
    lambda: fit(
        lr.RecorderCallback({"g": {"type": "ParameterGrad", "source": "body.0.weight"}}),
        probe_net(frozen=("body.0.weight",)),
    ),
    RecorderConfigError,
    r"`source`.*'body.0.weight'.*(trainable.*frozen|frozen.*trainable)",
    None,
)

# --------------------------------------------------------------------- function/method sources
FUNCTION_SOURCES: list[tuple[str, Any, str, str | None]] = [
    ("int", 5, r"`source`.*dotted path", None),
    ("none", None, r"`source`.*dotted path", None),
    ("empty", "", r"`source`.*dotted path", None),
    ("no-dot", "double", r"`source`.*dotted path", None),
    ("unimportable-module", "no_such_package.sub.func", r"`source`.*importable module", None),
    (
        "missing-attribute",
        "helpers.toy.tripple",
        r"'helpers.toy.tripple'.*no function 'tripple'.*'double'",
        None,
    ),
    ("constant", "helpers.toy.CONSTANT", r"'helpers.toy.CONSTANT' to be a function.*int", None),
]
for cls_name in ("FunctionOutputs", "FunctionInputs"):
    rec_cls = RECORDERS[cls_name][0]
    for suffix, source, match, pending in FUNCTION_SOURCES:
        case(
            f"{cls_name}Recorder-source-{suffix}",
            lambda c=rec_cls, s=source: init(c(s)),
            RecorderConfigError,
            match,
            pending,
        )
    case(
        f"{cls_name}Recorder-source-is-a-class",
        lambda c=rec_cls: init(c("helpers.toy.Toy")),
        InvalidSourceError,
        r"'helpers.toy.Toy'.*function",
    )
    case(
        f"{cls_name}Recorder-source-is-a-method",
        lambda c=rec_cls: init(c("helpers.toy.Toy.scale")),
        InvalidSourceError,
        r"`source`.*'helpers.toy.Toy.scale'.*function.*Method",
    )

METHOD_SOURCES: list[tuple[str, Any, str, str | None]] = [
    ("int", 5, r"`source`.*dotted path", None),
    ("no-class", "toy_module", r"`source`.*dotted path", None),
    ("unimportable-module", "no_such_package.Cls.meth", r"`source`.*importable module", None),
    ("missing-method", "helpers.toy.Toy.scael", r"'helpers.toy.Toy.scael'.*scale", None),
    ("not-a-class", "helpers.toy.add.scale", r"'helpers.toy.add'.*class", None),
    ("property", "helpers.toy.Toy.prop", r"'helpers.toy.Toy.prop'.*method", None),
    ("function-not-method", "helpers.toy.add", r"`source`.*'helpers.toy.add'.*method", None),
    (
        "builtin-type-method",
        "builtins.str.upper",
        r"`source`.*'builtins.str.upper'.*(builtin|C type|cannot be patched).*Python",
        None,
    ),
    (
        "c-type-method",
        "torch._C.TensorBase.relu",
        r"`source`.*'torch._C.TensorBase.relu'.*(builtin|C type|cannot be patched).*Python",
        None,
    ),
]
for cls_name in ("MethodOutputs", "MethodInputs"):
    rec_cls = RECORDERS[cls_name][0]
    for suffix, source, match, pending in METHOD_SOURCES:
        case(
            f"{cls_name}Recorder-source-{suffix}",
            lambda c=rec_cls, s=source: init(c(s)),
            RecorderConfigError,
            match,
            pending,
        )


# ------------------------------------------------------------------------------ get_record_data
def one_record() -> lr.BaseRecorder:
    return recorded(lr.ModuleOutputsRecorder("fc1"))


case(
    "get_record_data-record_idx-out-of-range",
    lambda: one_record().get_record_data(5),
    NoRecordError,
    r"`record_idx` in \[-1, 0\].*5",
)
case(
    "get_record_data-record_idx-negative-out-of-range",
    lambda: one_record().get_record_data(-2),
    NoRecordError,
    r"`record_idx` in \[-1, 0\].*-2",
)
case(
    "get_record_data-record_idx-str",
    lambda: one_record().get_record_data("a"),
    RecorderConfigError,
    r"`record_idx`.*int.*'a'",
    None,
)
case(
    "get_record_data-record_idx-float",
    lambda: one_record().get_record_data(0.5),
    RecorderConfigError,
    r"`record_idx`.*int.*0.5",
    None,
)
case(
    "get_record_data-record_idx-none",
    lambda: one_record().get_record_data(None),
    RecorderConfigError,
    r"`record_idx`.*int.*None",
    None,
)
case(
    "get_record_data-data_idx-into-tensor-out-of-range",
    lambda: one_record().get_record_data(0, 99),
    NoRecordError,
    r"`data_idx`.*Tensor.*99",
)
case(
    "get_record_data-data_idx-str-into-tensor",
    lambda: one_record().get_record_data(0, "x"),
    NoRecordError,
    r"`data_idx`.*Tensor.*'x'",
)
case(
    "get_record_data-data_idx-unknown-argument-name",
    lambda: recorded(lr.ModuleInputsRecorder("fc1")).get_record_data(0, "nonexistent"),
    NoRecordError,
    r"`data_idx`.*Arguments.*'nonexistent'",
)
case(
    "get_record_data-nothing-recorded",
    lambda: lr.ModuleOutputsRecorder("fc1").get_record_data(),
    NotInitializedError,
    r"not been initialized.*call `initialize\(model\)`",
)
case(
    "get_record_data-source-unknown",
    lambda: one_record().get_record_data(0, source="fc9"),
    RecorderConfigError,
    r"no stream 'fc9'.*Closest streams: 'fc1'",
)
case(
    "get_record_data-unknown-kwarg",
    lambda: one_record().get_record_data(0, idx=1),
    TypeError,
    r"unexpected keyword argument 'idx'",
)
case(
    "get_record_data-pattern-needs-source",
    lambda: recorded(lr.ModuleOutputsRecorder("fc*")).get_record_data(0),
    RecorderStateError,
    r"'fc1', 'fc2'.*`get_record_data\(\.\.\., source=name\)`",
)
case(
    "RecordStream-get_record_data-out-of-range",
    lambda: one_record().streams["fc1"].get_record_data(3),
    NoRecordError,
    r"`record_idx` in \[-1, 0\].*3",
)
case(
    "RecordStream-get_record_data-record_idx-str",
    lambda: one_record().streams["fc1"].get_record_data("a"),
    RecorderConfigError,
    r"`record_idx`.*int.*'a'",
    None,
)

# ------------------------------------------------------------------------------ RecorderManager
GOOD = {"type": "ModuleOutputs", "source": "fc1"}
case(
    "RecorderManager-int",
    lambda: lr.RecorderManager(5),
    RecorderConfigError,
    r"`recorders`.*mapping.*int",
    None,
)
case(
    "RecorderManager-list-of-names",
    lambda: lr.RecorderManager(["a", "b"]),
    RecorderConfigError,
    r"`recorders`.*(mapping|pairs).*'a'",
    None,
)
case(
    "RecorderManager-empty-dict",
    lambda: lr.RecorderManager({}),
    RecorderConfigError,
    r"`recorders`.*non-empty",
    None,
)
case(
    "RecorderManager-config-int",
    lambda: lr.RecorderManager({"a": 5}),
    RecorderConfigError,
    r"recorder 'a'.*mapping.*int",
)
case(
    "RecorderManager-config-without-type",
    lambda: lr.RecorderManager({"a": {"source": "fc1"}}),
    UnknownRecorderTypeError,
    r"recorder 'a'.*'type'.*ModuleOutputs",
)
case(
    "RecorderManager-unknown-type",
    lambda: lr.RecorderManager({"a": {"type": "ModuleOutput", "source": "fc1"}}),
    UnknownRecorderTypeError,
    r"'ModuleOutput'.*Closest types: 'ModuleOutputs'",
)
case(
    "RecorderManager-type-int",
    lambda: lr.RecorderManager({"a": {"type": 5, "source": "fc1"}}),
    UnknownRecorderTypeError,
    # nothing close: the full list, once (not a partial "include" list before it)
    r"^Unknown recorder type 5 in recorder 'a'\. Valid recorder types: FunctionInputs, .*, "
    r"ParameterRecorder\.$",
)
case(
    "RecorderManager-config-without-source",
    lambda: lr.RecorderManager({"a": {"type": "ModuleOutputs"}}),
    RecorderConfigError,
    r"recorder 'a'.*'source'",
)
case(
    "RecorderManager-unknown-option",
    lambda: lr.RecorderManager({"a": {**GOOD, "detatch": True}}),
    RecorderConfigError,
    r"'detatch'.*Closest options: 'detach'",
)
case(
    "RecorderManager-bad-option-value",
    lambda: lr.RecorderManager({"a": {**GOOD, "keep": 0}}),
    RecorderConfigError,
    r"`keep`.*positive int",
)
case(
    "RecorderManager-dtype-int",
    lambda: lr.RecorderManager({"a": {**GOOD, "dtype": 5}}),
    RecorderConfigError,
    r"`dtype`.*torch.dtype.*5",
)
case(
    "RecorderManager-duplicate-name",
    lambda: lr.RecorderManager([("a", GOOD), ("a", GOOD)]),
    DuplicateNameError,
    r"recorder named 'a' already exists.*names must be unique",
)
case(
    "RecorderManager-name-int",
    lambda: lr.RecorderManager({5: GOOD}),
    RecorderConfigError,
    r"non-empty str recorder name.*5",
)
case(
    "RecorderManager-name-empty",
    lambda: lr.RecorderManager({"": GOOD}),
    RecorderConfigError,
    r"non-empty str recorder name.*''",
)
case(
    "RecorderManager-add_recorder-duplicate",
    lambda: lr.RecorderManager({"a": GOOD}).add_recorder("a", GOOD),
    DuplicateNameError,
    r"recorder named 'a' already exists.*names must be unique",
)
case(
    "RecorderManager-get_recorder-unknown",
    lambda: lr.RecorderManager({"feat": GOOD}).get_recorder("faet"),
    RecorderConfigError,
    r"'faet'.*Closest recorder names: 'feat'",
)
case(
    "RecorderManager-get_recorder-int",
    lambda: lr.RecorderManager({"feat": GOOD}).get_recorder(5),
    RecorderConfigError,
    r"`name`.*str.*5",
    None,
)
case(
    "RecorderManager-initialize-unknown-source-releases-the-others",
    lambda: init(
        lr.RecorderManager({"ok": GOOD, "bad": {"type": "ModuleOutputs", "source": "fc9"}}),
        net(),
    ),
    UnknownSourceError,
    r"'fc9'.*Closest module names",
)
case(
    "RecorderManager-initialize-without-model",
    lambda: init(lr.RecorderManager({"a": GOOD}), None),
    RecorderConfigError,
    r"`initialize\(model\)`.*nn.Module",
)
case(
    "RecorderManager-unknown-kwarg",
    lambda: lr.RecorderManager({"a": GOOD}, strict=True),
    TypeError,
    r"unexpected keyword argument 'strict'",
)
case(
    "build_recorder-int",
    lambda: lr.build_recorder(5),
    RecorderConfigError,
    r"recorder config.*mapping.*int",
)
case(
    "build_recorder-empty-dict",
    lambda: lr.build_recorder({}),
    UnknownRecorderTypeError,
    r"'type' key.*ModuleOutputs",
)


class _NotARecorder:
    pass


class _Shadow(lr.ModuleOutputsRecorder):
    pass


case(
    "register_recorder-not-a-recorder-class",
    lambda: lr.register_recorder(_NotARecorder),
    RecorderConfigError,
    r"BaseRecorder subclass.*_NotARecorder",
)
case(
    "register_recorder-int",
    lambda: lr.register_recorder(5),
    RecorderConfigError,
    r"BaseRecorder subclass.*5",
)
case(
    "register_recorder-taken-name",
    lambda: lr.register_recorder(_Shadow, name="ModuleOutputs"),
    DuplicateNameError,
    r"'ModuleOutputs'.*replace=True",
)


# ----------------------------------------------------------------------------- RecorderCallback
def rc(recorders: Any = None, **kw: Any) -> lr.RecorderCallback:
    return lr.RecorderCallback(
        {"feat": {"type": "ModuleOutputs", "source": "probe"}} if recorders is None else recorders,
        **kw,
    )


for suffix, value, match, pending in [
    ("none", None, r"`recorders`.*non-empty dict", None),
    ("empty", {}, r"`recorders`.*non-empty dict", None),
    ("int", 5, r"`recorders`.*non-empty dict", None),
    ("list", [GOOD], r"`recorders`.*non-empty dict", None),
]:
    case(
        f"RecorderCallback-recorders-{suffix}",
        lambda v=value: lr.RecorderCallback(v),
        RecorderConfigError,
        match,
        pending,
    )
case(
    "RecorderCallback-config-int",
    lambda: lr.RecorderCallback({"a": 5}),
    RecorderConfigError,
    r"`recorders\['a'\]`.*config dict",
)
case(
    "RecorderCallback-unknown-type",
    lambda: lr.RecorderCallback({"a": {"type": "ModuleOutput", "source": "probe"}}),
    UnknownRecorderTypeError,
    r"'ModuleOutput'.*Closest types: 'ModuleOutputs'",
)
case(
    "RecorderCallback-unknown-option",
    lambda: lr.RecorderCallback({"a": {**GOOD, "kep": 1}}),
    RecorderConfigError,
    r"'kep'.*Closest options: 'keep'",
)
case(
    "RecorderCallback-dtype-int",
    lambda: lr.RecorderCallback({"a": {**GOOD, "dtype": 5}}),
    RecorderConfigError,
    r"`dtype`.*torch.dtype.*5",
)

STAGE_CASES: list[tuple[str, Any, str, str | None]] = [
    ("empty", [], r"`stages`.*(non-empty|at least one)", None),
    ("unknown", "fit", r"`stages`.*'train'.*'fit'", None),
    ("unknown-in-list", ["train", "valid"], r"`stages`.*'val'.*'valid'", None),
    ("int", 5, r"`stages`.*sequence of 'train'", None),
    ("none", None, r"`stages`.*sequence of 'train'", None),
]
STEP_CASES: list[tuple[str, Any]] = [("zero", 0), ("negative", -1), ("float", 1.5), ("bool", True)]

for suffix, value, match, pending in STAGE_CASES:
    case(
        f"RecorderCallback-stages-{suffix}",
        lambda v=value: rc(stages=v),
        RecorderConfigError,
        match,
        pending,
    )
for suffix, value in STEP_CASES:
    case(
        f"RecorderCallback-every_n_steps-{suffix}",
        lambda v=value: rc(every_n_steps=v),
        RecorderConfigError,
        r"`every_n_steps`.*positive int",
    )
case("RecorderCallback-name-int", lambda: rc(name=5), RecorderConfigError, r"`name`.*str")
case(
    "RecorderCallback-keep_hooks-str",
    lambda: rc(keep_hooks="yes"),
    RecorderConfigError,
    r"`keep_hooks`.*True, False or None",
)
case(
    "RecorderCallback-unknown-kwarg",
    lambda: rc(every_n_step=2),
    TypeError,
    r"unexpected keyword argument 'every_n_step'",
)
case(
    "RecorderCallback-unknown-source-at-fit",
    lambda: fit(rc({"feat": {"type": "ModuleOutputs", "source": "prob"}})),
    UnknownSourceError,
    r"'prob'.*Closest module names: 'probe'",
)
case(
    "RecorderCallback-unknown-parameter-at-fit",
    lambda: fit(rc({"w": {"type": "Parameter", "source": "body.0.wieght"}})),
    UnknownSourceError,
    r"'body.0.wieght'.*Closest parameter names: 'body.0.weight'",
)
case(
    "RecorderCallback-get_recorder-before-fit",
    lambda: rc().get_recorder("feat"),
    NotInitializedError,
    r"no recorders outside a run.*when fit, validate",
)
for cls in (lr.RecorderCallback, lr.FeatureStatsMonitor):
    case(
        f"{cls.__name__}-of-module-without-trainer",
        lambda c=cls: c.of(probe_net()),
        RecorderStateError,
        r"ProbeNet given to \w+\.of to be attached to a Trainer but it is not.*pass the Trainer",
    )
case(
    "RecorderCallback-get_record_data-before-fit",
    lambda: rc().get_record_data("feat"),
    RecorderStateError,
    r"no recorders outside a run.*when fit, validate",
)


# -------------------------------------------------------------------------- FeatureStatsMonitor
def fsm(sources: Any = "probe", **kw: Any) -> lr.FeatureStatsMonitor:
    return lr.FeatureStatsMonitor(sources, **kw)


for suffix, value in [
    ("none", None),
    ("empty-list", []),
    ("int", 5),
    ("list-with-int", ["probe", 5]),
    ("empty-str", ""),
]:
    case(
        f"FeatureStatsMonitor-sources-{suffix}",
        lambda v=value: fsm(v),
        RecorderConfigError,
        r"`sources`.*module name",
    )
for suffix, value, match, pending in [
    (
        "none",
        None,
        r"`stats`.*'mean'.*None",
        None,
    ),
    ("empty", [], r"`stats`.*(non-empty|at least one).*'mean'", None),
    ("unknown", ["mean", "median"], r"`stats`.*'mean'.*'median'", None),
    ("unknown-str", "avg", r"`stats`.*'mean'.*'avg'", None),
    ("int", 5, r"`stats`.*'mean'.*5", None),
]:
    case(
        f"FeatureStatsMonitor-stats-{suffix}",
        lambda v=value: fsm(stats=v),
        RecorderConfigError,
        match,
        pending,
    )
for suffix, value in [("zero", 0), ("negative", -3), ("float", 2.5), ("str", "30")]:
    case(
        f"FeatureStatsMonitor-bins-{suffix}",
        lambda v=value: fsm(bins=v),
        RecorderConfigError,
        r"`bins`.*positive int",
    )
case(
    "FeatureStatsMonitor-histograms-str",
    lambda: fsm(histograms="yes"),
    RecorderConfigError,
    r"`histograms`.*bool",
)
# `parameters` also takes name patterns (a str is one): a number is neither a bool nor a pattern.
case(
    "FeatureStatsMonitor-parameters-int",
    lambda: fsm(parameters=3),
    RecorderConfigError,
    r"`parameters`.*bool",
)
case("FeatureStatsMonitor-clone-int", lambda: fsm(clone=1), RecorderConfigError, r"`clone`.*bool")
case(
    "FeatureStatsMonitor-pool_dataloaders-int",
    lambda: fsm(pool_dataloaders=1),
    RecorderConfigError,
    r"`pool_dataloaders`.*bool",
)
case(
    "TensorBoardLogger-unknown-writer-option",
    lambda: lr.TensorBoardLogger("unused", flush_sec=5),
    RecorderConfigError,
    r"SummaryWriter options .*'flush_secs'.* but got 'flush_sec'",
)
for suffix, kw, match in [
    ("save_dir-none", {"save_dir": None}, r"`save_dir` of TensorBoardLogger to be a path.*None"),
    ("save_dir-int", {"save_dir": 5}, r"`save_dir` of TensorBoardLogger to be a path.*got 5"),
    ("flush_secs-str", {"flush_secs": "30"}, r"`flush_secs`.*positive number but got '30'"),
    ("flush_secs-zero", {"flush_secs": 0}, r"`flush_secs`.*positive number but got 0"),
    ("max_queue-float", {"max_queue": 2.5}, r"`max_queue`.*non-negative int but got 2.5"),
    ("max_queue-negative", {"max_queue": -1}, r"`max_queue`.*non-negative int but got -1"),
    ("purge_step-str", {"purge_step": "10"}, r"`purge_step`.*non-negative int or None"),
    ("filename_suffix-int", {"filename_suffix": 5}, r"`filename_suffix`.*str but got 5"),
    ("comment-none", {"comment": None}, r"`comment`.*str but got None"),
]:
    case(
        f"TensorBoardLogger-{suffix}",
        lambda k=kw: lr.TensorBoardLogger(**{"save_dir": scratch(), **k}),
        RecorderConfigError,
        match,
    )
case(
    "FeatureStatsMonitor-exact_histograms-str",
    lambda: fsm(exact_histograms="yes"),
    RecorderConfigError,
    r"`exact_histograms`.*bool",
)
for suffix, bad in (("zero", 0), ("negative", -50), ("float", 100.0), ("bool", True)):
    case(
        f"FeatureStatsMonitor-histogram_every_n_steps-{suffix}",
        lambda bad=bad: fsm(histogram_every_n_steps=bad),
        RecorderConfigError,
        r"`histogram_every_n_steps`.*positive int",
    )
case(
    "FeatureStatsMonitor-histogram_every_n_steps-without-histograms",
    lambda: fsm(histograms=False, histogram_every_n_steps=100),
    RecorderConfigError,
    r"`histogram_every_n_steps`.*None with histograms=False.*but got 100",
)
case(
    "FeatureStatsMonitor-histogram_every_n_steps-not-a-multiple",
    lambda: fsm(every_n_steps=50, histogram_every_n_steps=120),
    RecorderConfigError,
    r"multiple of the 50 steps between logged steps \(`every_n_steps`\).*got 120; 100 or 150",
)
for suffix, bad in (("zero", 0), ("float", 2.5), ("bool", True)):
    case(
        f"FeatureStatsMonitor-histogram_sample-{suffix}",
        lambda bad=bad: fsm(histogram_sample=bad),
        RecorderConfigError,
        r"`histogram_sample`.*positive",
    )
for suffix, value in [("empty", ""), ("trailing-slash", "stats/"), ("int", 5)]:
    case(
        f"FeatureStatsMonitor-prefix-{suffix}",
        lambda v=value: fsm(prefix=v),
        RecorderConfigError,
        r"`prefix`.*non-empty str",
    )
for suffix, value, match, pending in STAGE_CASES:
    case(
        f"FeatureStatsMonitor-stages-{suffix}",
        lambda v=value: fsm(stages=v),
        RecorderConfigError,
        match,
        pending,
    )
for suffix, value in STEP_CASES:
    case(
        f"FeatureStatsMonitor-every_n_steps-{suffix}",
        lambda v=value: fsm(every_n_steps=v),
        RecorderConfigError,
        r"`every_n_steps`.*positive int",
    )
case(
    "FeatureStatsMonitor-keep_hooks-int",
    lambda: fsm(keep_hooks=1),
    RecorderConfigError,
    r"`keep_hooks`.*True, False or None",
)
case(
    "FeatureStatsMonitor-unknown-kwarg",
    lambda: fsm(stat=["mean"]),
    TypeError,
    r"unexpected keyword argument 'stat'",
)
case(
    "FeatureStatsMonitor-unknown-source-at-fit",
    lambda: fit(fsm("prob"), logger=True),
    UnknownSourceError,
    r"'prob'.*Closest module names: 'probe'",
)


def tracking(selected: Any) -> lr.FeatureStatsMonitor:
    """A monitor of ``body.0`` (outputs of shape (4, 8)) whose channel selector returns
    ``selected``."""
    monitor = fsm("body.0")
    monitor.track_channels(lambda series, module: selected)
    return monitor


for suffix, selected, match in [
    ("str", "x", r"selector .* to return True, False, None or a dimension.*'body.0'.*str 'x'"),
    ("float", 1.7, r"selector .* to return True, False, None or a dimension.*float 1.7"),
    ("dim-too-large", 7, r"dimension a `track_channels` selector.*shape \(4, 8\).*-2 to 1.*7"),
    ("dim-too-small", -3, r"dimension a `track_channels` selector.*-2 to 1, but got -3"),
]:
    case(
        f"FeatureStatsMonitor-track_channels-{suffix}-at-fit",
        lambda v=selected: fit(tracking(v), logger=True, log_every_n_steps=1),
        RecorderConfigError,
        match,
    )
case(
    "FeatureStatsMonitor-no-logger-at-fit",
    lambda: fit(fsm("probe"), logger=False),
    RecorderConfigError,
    r"Expected the Trainer to have a logger.*pass a logger such as TensorBoardLogger",
)

# --------------------------------------------------------------------------- FeatureDistillation
case(
    "FeatureDistillation-teacher-none",
    lambda: lr.FeatureDistillation(None, {"a": "b"}),
    RecorderConfigError,
    r"`teacher`.*nn.Module.*NoneType",
)
case(
    "FeatureDistillation-teacher-str",
    lambda: lr.FeatureDistillation("teacher.ckpt", {"a": "b"}),
    RecorderConfigError,
    r"`teacher`.*nn.Module.*str",
)
for suffix, value in [
    ("empty", {}),
    ("none", None),
    ("list", ["features.0"]),
    ("empty-name", {"": "features.0"}),
    ("int-name", {"features.0": 0}),
]:
    case(
        f"FeatureDistillation-pairs-{suffix}",
        lambda v=value: distill(pairs=v),
        RecorderConfigError,
        r"`pairs`.*(mapping|module names)",
    )
case(
    "FeatureDistillation-pairs-total",
    lambda: distill(pairs={"total": "head"}),
    RecorderConfigError,
    r"'total' in `pairs`.*pair a module inside",
)
for suffix, value, match, pending in [
    ("nan", NAN, r"`weight`.*finite.*nan", None),
    ("inf", INF, r"`weight`.*finite.*inf", None),
    ("negative", -1.0, r"weight`? of pair 'features.0'.*non-negative number.*-1.0", None),
    ("str", "1", r"weight.*non-negative number", None),
    ("bool", True, r"weight.*non-negative number", None),
    (
        "per-pair-nan",
        {"features.0": NAN},
        r"weight.*'features.0'.*finite",
        None,
    ),
    ("unknown-pair", {"features.9": 1.0}, r"`weight`.*student module names from `pairs`", None),
    ("missing-pair", {}, r"`weight`.*every pair", None),
]:
    case(
        f"FeatureDistillation-weight-{suffix}",
        lambda v=value: distill(weight=v),
        RecorderConfigError,
        match,
        pending,
    )
for suffix, value, match, pending in [
    ("unknown", "mse2", r"loss.*'mse2'.*Closest types: 'mse'", None),
    ("int", 5, r"loss.*name, an nn.Module or a callable", None),
    ("none", None, r"loss.*name, an nn.Module or a callable", None),
    ("unknown-pair", {"features.9": "mse"}, r"`loss`.*student module names from `pairs`", None),
    ("class-not-module", dict, r"loss class.*torch.nn.Module.*dict", None),
]:
    case(
        f"FeatureDistillation-loss-{suffix}",
        lambda v=value: distill(loss=v),
        RecorderConfigError,
        match,
        pending,
    )
for suffix, kw, match, pending in [
    (
        "int",
        {"loss_options": 5},
        r"`loss_options`.*mapping.*int",
        None,
    ),
    (
        "list",
        {"loss_options": ["temperature"]},
        r"`loss_options`.*mapping",
        None,
    ),
    (
        "unknown-option",
        {"loss": "kl", "loss_options": {"temprature": 2.0}},
        r"'temprature'.*Closest options: 'temperature'",
        None,
    ),
    (
        "dim-str",
        {"loss": "cosine", "loss_options": {"dim": "x"}},
        r"`dim`.*int.*'x'",
        None,
    ),
    (
        "temperature-zero",
        {"loss": "kl", "loss_options": {"temperature": 0}},
        r"`temperature`.*positive",
        None,
    ),
    (
        "temperature-nan",
        {"loss": "kl", "loss_options": {"temperature": NAN}},
        r"`temperature`.*positive.*nan",
        None,
    ),
]:
    case(
        f"FeatureDistillation-loss_options-{suffix}",
        lambda k=kw: distill(**k),
        RecorderConfigError,
        match,
        pending,
    )
for suffix, value, match, pending in [
    (
        "unknown",
        "linear",
        r"`connectors`.*'auto'.*'linear'",
        None,
    ),
    (
        "int",
        5,
        r"`connectors`.*'auto'.*'identity'",
        None,
    ),
    (
        "unknown-pair",
        {"features.9": "auto"},
        r"`connectors`.*student module names from `pairs`",
        None,
    ),
]:
    case(
        f"FeatureDistillation-connectors-{suffix}",
        lambda v=value: distill(connectors=v),
        RecorderConfigError,
        match,
        pending,
    )
for suffix, value, pending in [
    ("negative", -0.1, None),
    ("str", "0.1", None),
    ("bool", True, None),
    ("nan", NAN, None),
    ("inf", INF, None),
]:
    case(
        f"FeatureDistillation-connector_lr-{suffix}",
        lambda v=value: distill(connector_lr=v),
        RecorderConfigError,
        r"`connector_lr`.*(non-negative|finite) number",
        pending,
    )
for suffix, value in [("negative", -1), ("float", 0.5), ("bool", True)]:
    case(
        f"FeatureDistillation-optimizer_idx-{suffix}",
        lambda v=value: distill(optimizer_idx=v),
        RecorderConfigError,
        r"`optimizer_idx`.*non-negative int",
    )
for flag in ("resize", "add_to_loss", "log_validation"):
    case(
        f"FeatureDistillation-{flag}-str",
        lambda f=flag: distill(**{f: "yes"}),
        RecorderConfigError,
        rf"`{flag}`.*bool",
    )
case(
    "FeatureDistillation-teacher_input-int",
    lambda: distill(teacher_input=5),
    RecorderConfigError,
    r"`teacher_input`.*callable",
)
case(
    "FeatureDistillation-log_prefix-empty",
    lambda: distill(log_prefix=""),
    RecorderConfigError,
    r"`log_prefix`.*non-empty str",
)
case(
    "FeatureDistillation-log_prefix-int",
    lambda: distill(log_prefix=5),
    RecorderConfigError,
    r"`log_prefix`.*non-empty str",
)
case(
    "FeatureDistillation-teacher_checkpoint-int",
    lambda: distill(teacher_checkpoint=5),
    RecorderConfigError,
    r"`teacher_checkpoint`.*path.*int",
    None,
)
case(
    "FeatureDistillation-teacher_checkpoint-missing-file",
    lambda: distill(teacher_checkpoint="/nonexistent/teacher.ckpt"),
    RecorderConfigError,
    r"`teacher_checkpoint`.*'/nonexistent/teacher.ckpt'.*(No such file|not found|does not exist)",
)


class _Unsafe:
    """Pickled into a checkpoint: a weights-only load refuses it."""


def garbage_bytes() -> str:
    return garbage_file()


def garbage_text() -> str:
    path = Path(scratch()) / "garbage.ckpt"
    path.write_text("hello world")
    return str(path)


def unsafe_pickle() -> str:
    path = Path(scratch()) / "garbage.ckpt"
    torch.save({"state_dict": _Unsafe()}, path)
    return str(path)


def checkpoint_error(make_file: Callable[[], str]) -> None:
    try:
        distill(teacher_checkpoint=make_file())
    except RecorderConfigError as err:
        # The package error must not pass on torch's advice to load untrusted data unsafely.
        assert "weights_only=False" not in str(err) and "weights_only` set to `False" not in str(
            err
        ), str(err)
        raise


for suffix, make_file, pending in [
    (
        "garbage-bytes",
        garbage_bytes,
        None,
    ),
    ("text-file", garbage_text, None),
    (
        "unsafe-pickle",
        unsafe_pickle,
        None,
    ),
]:
    case(
        f"FeatureDistillation-teacher_checkpoint-{suffix}",
        lambda m=make_file: checkpoint_error(m),
        RecorderConfigError,
        r"`teacher_checkpoint`.*garbage.ckpt.*(state dict|checkpoint)",
        pending,
    )
case(
    "FeatureDistillation-teacher_checkpoint-wrong-weights",
    lambda: distill(teacher_checkpoint=wrong_weights_file()),
    RecorderConfigError,
    r"`teacher_checkpoint`.*teacher's weights",
)


def wrong_weights_file() -> str:
    path = Path(scratch()) / "other.pt"
    torch.save(nn.Linear(2, 2).state_dict(), path)
    return str(path)


for suffix, value, pending in [
    ("int", 5, None),
    ("config-int", {"d": 5}, None),
    ("unknown-type", {"d": {"type": "Functions", "source": "helpers.toy.double"}}, None),
]:
    case(
        f"FeatureDistillation-deliveries-{suffix}",
        lambda v=value: distill(deliveries=v),
        RecorderConfigError,
        r"(`deliveries`|delivery 'd').*(mapping|'FunctionOutputs')",
        pending,
    )
case(
    "FeatureDistillation-unknown-kwarg",
    lambda: distill(temperature=4.0),
    TypeError,
    r"unexpected keyword argument 'temperature'",
)
case(
    "FeatureDistillation-unknown-student-module-at-fit",
    lambda: fit(distill(pairs={"features.9": "features.0"}), distill=True),
    UnknownSourceError,
    r"'features.9'.*Closest module names",
)
case(
    "FeatureDistillation-unknown-teacher-module-at-fit",
    lambda: fit(distill(pairs={"features.0": "feature.0"}), distill=True),
    UnknownSourceError,
    r"'feature.0'.*Closest module names: 'features.0'",
)
case(
    "FeatureDistillation-optimizer_idx-too-large-at-fit",
    lambda: fit(distill(optimizer_idx=3), distill=True),
    RecorderConfigError,
    r"`optimizer_idx`.*below the number of optimizers",
)
case(
    "distillation_loss-not-a-module",
    lambda: lr.distillation_loss(5),
    RecorderConfigError,
    r"`pl_module`.*LightningModule.*int",
    None,
)
case(
    "distillation_loss-no-callback",
    lambda: lr.distillation_loss(student()),
    RecorderStateError,
    r"FeatureDistillation\(\.\.\., add_to_loss=False\)",
)

# -------------------------------------------------------------------------------------- losses
for suffix, spec, match in [
    ("unknown-name", "mse2", r"Unknown loss type 'mse2'.*Closest types: 'mse'"),
    ("int", 5, r"loss to be a name, an nn.Module or a callable.*int"),
    ("none", None, r"loss to be a name, an nn.Module or a callable.*NoneType"),
    ("empty-name", "", r"Unknown loss type ''.*Valid loss types: attention"),
    ("class-not-module", int, r"loss class to subclass torch.nn.Module.*int"),
]:
    case(f"get_loss-{suffix}", lambda s=spec: lr.get_loss(s), RecorderConfigError, match)
case(
    "get_loss-unknown-option",
    lambda: lr.get_loss("kl", temprature=2.0),
    RecorderConfigError,
    r"'temprature'.*Closest options: 'temperature'",
)
case(
    "get_loss-option-for-optionless-loss",
    lambda: lr.get_loss("mse", reduction="sum"),
    RecorderConfigError,
    r"no options.*'reduction'",
)
case(
    "get_loss-options-with-module",
    lambda: lr.get_loss(nn.MSELoss(), reduction="sum"),
    RecorderConfigError,
    r"no options with an nn.Module loss.*'reduction'",
)
case(
    "get_loss-callable-unknown-option",
    lambda: lr.get_loss(lambda s, t: (s - t).sum(), scale=2),
    RecorderConfigError,
    r"options of <lambda>.*'scale'",
)
for loss_name, option in (("kl", "temperature"), ("at", "p")):
    for suffix, value, pending in [
        ("zero", 0.0, None),
        ("negative", -1.0, None),
        ("nan", NAN, None),
        ("inf", INF, None),
        ("str", "2", None),
    ]:
        case(
            f"get_loss-{loss_name}-{option}-{suffix}",
            lambda n=loss_name, o=option, v=value: lr.get_loss(n, **{o: v}),
            RecorderConfigError,
            rf"`{option}`.*positive (finite )?number",
            pending,
        )
case(
    "AttentionTransferLoss-distance-unknown",
    lambda: lr.AttentionTransferLoss(distance="l3"),
    RecorderConfigError,
    r"`distance`.*'mse'.*'l3'",
)
for cls_name, cls in (("KLDivLoss", lr.KLDivLoss), ("CosineLoss", lr.CosineLoss)):
    for suffix, value, pending in [
        ("str", "x", None),
        ("float", 1.5, None),
        ("bool", True, None),
    ]:
        case(
            f"{cls_name}-dim-{suffix}",
            lambda c=cls, v=value: c(dim=v),
            RecorderConfigError,
            r"`dim`.*int or None",
            pending,
        )
case(
    "KLDivLoss-unknown-kwarg",
    lambda: lr.KLDivLoss(tau=2.0),
    TypeError,
    r"unexpected keyword argument 'tau'",
)
case(
    "MSELoss-unknown-kwarg",
    lambda: lr.MSELoss(reduction="sum"),
    TypeError,
    r"unexpected keyword argument 'reduction'",
)
for fn_name, fn in (
    ("mse_loss", lr.mse_loss),
    ("l1_loss", lr.l1_loss),
    ("cosine_loss", lr.cosine_loss),
    ("kl_div_loss", lr.kl_div_loss),
    ("attention_transfer_loss", lr.attention_transfer_loss),
):
    case(
        f"{fn_name}-student-int",
        lambda f=fn: f(5, t(2, 3, 4, 4)),
        RecorderConfigError,
        r"`student`.*torch.Tensor.*int",
    )
    case(
        f"{fn_name}-teacher-none",
        lambda f=fn: f(t(2, 3, 4, 4), None),
        RecorderConfigError,
        r"`teacher`.*torch.Tensor.*NoneType",
    )
for fn_name, fn in (
    ("mse_loss", lr.mse_loss),
    ("l1_loss", lr.l1_loss),
    ("cosine_loss", lr.cosine_loss),
    ("kl_div_loss", lr.kl_div_loss),
):
    case(
        f"{fn_name}-shape-mismatch",
        lambda f=fn: f(t(2, 3), t(2, 4)),
        RecorderConfigError,
        r"same shape.*\(2, 3\).*\(2, 4\)",
    )
case(
    "cosine_loss-dim-out-of-range",
    lambda: lr.cosine_loss(t(2, 3), t(2, 3), dim=5),
    RecorderConfigError,
    r"`dim`.*\[-2, 1\].*5",
)
case(
    "kl_div_loss-dim-out-of-range",
    lambda: lr.kl_div_loss(t(2, 3), t(2, 3), dim=-3),
    RecorderConfigError,
    r"`dim`.*\[-2, 1\].*-3",
)
case(
    "kl_div_loss-temperature-zero",
    lambda: lr.kl_div_loss(t(2, 3), t(2, 3), temperature=0),
    RecorderConfigError,
    r"`temperature`.*positive",
)
case("cosine_loss-1d", lambda: lr.cosine_loss(t(3), t(3)), RecorderConfigError, r"batch dim.*2-D")
case(
    "attention_transfer_loss-1d",
    lambda: lr.attention_transfer_loss(t(3), t(3)),
    RecorderConfigError,
    r"attention transfer.*(rank|2-D|\(N, C, H, W\))",
)
case(
    "attention_transfer_loss-spatial-mismatch",
    lambda: lr.attention_transfer_loss(t(2, 3, 4, 4), t(2, 5, 8, 8)),
    RecorderConfigError,
    r"same batch and spatial size",
)
case(
    "attention_transfer_loss-p-zero",
    lambda: lr.attention_transfer_loss(t(2, 3, 4, 4), t(2, 5, 4, 4), p=0),
    RecorderConfigError,
    r"`p`.*positive",
)
case(
    "MSELoss-forward-teacher-int",
    lambda: lr.MSELoss()(t(2, 3), 5),
    RecorderConfigError,
    r"`teacher`.*torch.Tensor.*int",
)

# ---------------------------------------------------------------------------------- connectors
for suffix, s_shape, t_shape, match in [
    ("student-int", 5, (2, 3), r"`student_shape`.*sequence of ints"),
    ("teacher-str", (2, 3), "2x3", r"`teacher_shape`.*positive sizes"),
    ("zero-size", (2, 0), (2, 3), r"`student_shape`.*positive sizes"),
    ("negative-size", (2, 3), (2, -3), r"`teacher_shape`.*positive sizes"),
    ("float-size", (2, 3.5), (2, 3), r"`student_shape`.*positive sizes.*3.5"),
    ("rank-mismatch", (2, 3), (2, 3, 4, 4), r"same rank"),
    ("five-d", (2, 3, 4, 4, 4), (2, 3, 4, 4, 4), r"2-D \(N, C\), 3-D \(N, L, C\) or 4-D"),
    ("token-length-mismatch", (2, 5, 3), (2, 6, 3), r"same length L"),
    ("spatial-mismatch", (2, 3, 4, 4), (2, 3, 8, 8), r"same spatial size.*resize=True"),
    ("empty", (), (), r"2-D \(N, C\).*student \(\)"),
]:
    case(
        f"build_connector-{suffix}",
        lambda s=s_shape, tt=t_shape: lr.build_connector(s, tt),
        RecorderConfigError,
        match,
    )
case(
    "build_connector-resize-str",
    lambda: lr.build_connector((2, 3, 4, 4), (2, 3, 8, 8), resize="yes"),
    RecorderConfigError,
    r"`resize`.*bool",
    None,
)
case(
    "build_connector-unknown-kwarg",
    lambda: lr.build_connector((2, 3), (2, 3), bias=False),
    TypeError,
    r"unexpected keyword argument 'bias'",
)
for suffix, spec, match in [
    ("unknown-name", "linear", r"connector to be one of.*'auto'.*'linear'"),
    ("int", 5, r"connector to be None, 'auto', 'identity', an nn.Module or a factory"),
    ("factory-returns-int", lambda s, tt: 5, r"connector factory to return an nn.Module.*int"),
]:
    case(
        f"resolve_connector-{suffix}",
        lambda sp=spec: lr.resolve_connector(sp, t(2, 3), t(2, 4)),
        RecorderConfigError,
        match,
    )
case(
    "resolve_connector-student-int",
    lambda: lr.resolve_connector("auto", 5, t(2, 4)),
    RecorderConfigError,
    r"`student_feature`.*torch.Tensor.*int",
)
case(
    "resolve_connector-teacher-none",
    lambda: lr.resolve_connector("auto", t(2, 3), None),
    RecorderConfigError,
    r"`teacher_feature`.*torch.Tensor.*NoneType",
)
case(
    "resolve_connector-identity-shape-mismatch",
    lambda: lr.resolve_connector("identity", t(2, 3), t(2, 4)),
    RecorderConfigError,
    r"identity.*(same shape|\(2, 3\))",
    None,
)

# --------------------------------------------------------------------------------------- stats
for fn_name, fn in (
    ("feature_stats", stats.feature_stats),
    ("histogram", stats.histogram),
    ("histogram_raw_kwargs", stats.histogram_raw_kwargs),
    ("tensor_norm", stats.tensor_norm),
):
    arg = "t" if fn_name == "tensor_norm" else "x"
    case(f"{fn_name}-int", lambda f=fn: f(5), RecorderConfigError, rf"`{arg}`.*torch.Tensor.*int")
    case(
        f"{fn_name}-none",
        lambda f=fn: f(None),
        RecorderConfigError,
        rf"`{arg}`.*torch.Tensor.*NoneType",
    )
    case(
        f"{fn_name}-list",
        lambda f=fn: f([1.0, 2.0]),
        RecorderConfigError,
        rf"`{arg}`.*torch.Tensor.*list",
    )
    case(
        f"{fn_name}-complex",
        lambda f=fn: f(torch.ones(3, dtype=torch.complex64)),
        RecorderConfigError,
        rf"`{arg}`.*real dtype.*complex64",
    )
for suffix, value in [("negative", -1), ("float", 0.5), ("str", "1"), ("bool", True)]:
    case(
        f"feature_stats-correction-{suffix}",
        lambda v=value: stats.feature_stats(t(5), correction=v),
        RecorderConfigError,
        r"`correction`.*non-negative int",
    )
    case(
        f"FeatureStats-correction-{suffix}",
        lambda v=value: stats.FeatureStats(correction=v),
        RecorderConfigError,
        r"`correction`.*non-negative int",
    )
for fn_name, fn in (
    ("histogram", stats.histogram),
    ("histogram_raw_kwargs", stats.histogram_raw_kwargs),
):
    for suffix, value in [
        ("zero", 0),
        ("negative", -5),
        ("float", 10.0),
        ("str", "10"),
        ("none", None),
    ]:
        case(
            f"{fn_name}-bins-{suffix}",
            lambda f=fn, v=value: f(t(10), bins=v),
            RecorderConfigError,
            r"`bins`.*positive int",
        )
case(
    "FeatureStats-update-int",
    lambda: stats.FeatureStats().update(5),
    RecorderConfigError,
    r"`x`.*torch.Tensor.*int",
)
case(
    "FeatureStats-unknown-kwarg",
    lambda: stats.FeatureStats(colour="red"),
    RecorderConfigError,
    r"Unexpected keyword arguments: `colour`",
)
for suffix, value, match, pending in [
    (
        "int",
        5,
        r"`tensors`.*iterable of tensors.*int",
        None,
    ),
    (
        "none",
        None,
        r"`tensors`.*iterable of tensors.*NoneType",
        None,
    ),
    (
        "list-of-int",
        [5],
        r"`tensors`.*tensors.*int",
        None,
    ),
]:
    case(
        f"global_norm-{suffix}",
        lambda v=value: stats.global_norm(v),
        RecorderConfigError,
        match,
        pending,
    )
case(
    "update_ratio-before-int",
    lambda: stats.update_ratio(5, t(3)),
    RecorderConfigError,
    r"`before`.*torch.Tensor.*int",
)
case(
    "update_ratio-after-none",
    lambda: stats.update_ratio(t(3), None),
    RecorderConfigError,
    r"`after`.*torch.Tensor.*NoneType",
)
case(
    "update_ratio-shape-mismatch",
    lambda: stats.update_ratio(t(3), t(4)),
    RecorderConfigError,
    r"`after`.*shape of `before`",
)
case(
    "update_ratio-eps-negative",
    lambda: stats.update_ratio(t(3), t(3), eps=-1.0),
    RecorderConfigError,
    r"`eps`.*non-negative number",
)
case(
    "update_ratio-eps-nan",
    lambda: stats.update_ratio(t(3), t(3), eps=NAN),
    RecorderConfigError,
    r"`eps`.*non-negative number.*nan",
)
case(
    "update_ratio-eps-str",
    lambda: stats.update_ratio(t(3), t(3), eps="0"),
    RecorderConfigError,
    r"`eps`.*non-negative number",
    None,
)

# ---------------------------------------------------------------------------------------- bulk
COLLECTORS = {
    "ForwardInputsCollector": bulk.ForwardInputsCollector,
    "ForwardOutputsCollector": bulk.ForwardOutputsCollector,
    "OutputGradsCollector": bulk.OutputGradsCollector,
}
for col_name, col_cls in COLLECTORS.items():
    for suffix, kw, error, match, pending in [
        ("condition-int", {"condition": 5}, RecorderConfigError, r"`condition`.*callable", None),
        (
            "reduction-str",
            {"reduction": "sum"},
            RecorderConfigError,
            r"`reduction`.*callable",
            None,
        ),
        ("detach-str", {"detach": "no"}, RecorderConfigError, r"`detach`.*bool", None),
        ("clone-none", {"clone": None}, RecorderConfigError, r"`clone`.*bool", None),
        ("device-gpu", {"device": "gpu"}, RecorderConfigError, r"`device`.*device string", None),
        (
            "dtype-int",
            {"dtype": 5},
            RecorderConfigError,
            r"`dtype`.*torch.dtype",
            None,
        ),
        ("dtype-unknown", {"dtype": "float17"}, RecorderConfigError, r"`dtype`.*torch.dtype", None),
        ("path-float", {"path": 1.5}, RecorderConfigError, r"`path`.*int, a str", None),
        (
            "unknown-kwarg",
            {"types": nn.Linear},
            TypeError,
            r"unexpected keyword argument 'types'",
            None,
        ),
    ]:
        case(f"{col_name}-{suffix}", lambda c=col_cls, k=kw: c(**k), error, match, pending)
    case(
        f"{col_name}-children-model-int",
        lambda c=col_cls: c().children(5),
        RecorderConfigError,
        r"`model`.*nn.Module.*int",
    )
    case(
        f"{col_name}-children-indices-out-of-range",
        lambda c=col_cls: collect(c(), indices=[7]),
        UnknownSourceError,
        r"`indices`.*\[0, 3\).*7.*Linear",
    )
    case(
        f"{col_name}-modules-types-absent",
        lambda c=col_cls: collect(c(), "modules", types=nn.Conv2d),
        UnknownSourceError,
        r"types Conv2d.*model.modules\(\) yields",
    )

for suffix, how, kw, error, match, pending in [
    (
        "indices-float",
        "children",
        {"indices": 1.0},
        RecorderConfigError,
        r"`indices`.*ints.*float",
        None,
    ),
    (
        "indices-float-item",
        "children",
        {"indices": [1.0]},
        RecorderConfigError,
        r"`indices`.*ints.*float",
        None,
    ),
    (
        "indices-negative",
        "children",
        {"indices": [-1]},
        UnknownSourceError,
        r"`indices`.*\[0, 3\).*-1",
        None,
    ),
    (
        "indices-str",
        "children",
        {"indices": "0"},
        RecorderConfigError,
        r"`indices`.*ints.*str",
        None,
    ),
    (
        "indices-bool",
        "modules",
        {"indices": [True]},
        RecorderConfigError,
        r"`indices`.*ints.*bool",
        None,
    ),
    (
        "indices-empty",
        "modules",
        {"indices": []},
        RecorderConfigError,
        r"`indices`.*(non-empty|at least one)",
        None,
    ),
    (
        "types-int",
        "children",
        {"types": 5},
        RecorderConfigError,
        r"`types`.*nn.Module classes",
        None,
    ),
    (
        "types-not-module",
        "children",
        {"types": int},
        RecorderConfigError,
        r"`types`.*nn.Module classes",
        None,
    ),
    (
        "types-empty",
        "children",
        {"types": []},
        RecorderConfigError,
        r"`types`.*nn.Module classes",
        None,
    ),
    (
        "types-unknown-name",
        "modules",
        {"types": "Linaer"},
        RecorderConfigError,
        r"'Linaer'.*Closest torch.nn classes: 'Linear'",
        None,
    ),
    (
        "types-unimportable",
        "modules",
        {"types": "no_such_package.Block"},
        RecorderConfigError,
        r"import.*'no_such_package'",
        None,
    ),
    (
        "types-and-indices-disjoint",
        "children",
        {"types": nn.ReLU, "indices": [0]},
        UnknownSourceError,
        r"types ReLU and indices \[0\]",
        None,
    ),
    (
        "unknown-kwarg",
        "children",
        {"index": [0]},
        TypeError,
        r"unexpected keyword argument 'index'",
        None,
    ),
    ("model-none", "modules", {}, RecorderConfigError, r"`model`.*nn.Module.*NoneType", None),
]:
    model_arg = None if suffix == "model-none" else "net"
    case(
        f"ForwardOutputsCollector-{how}-{suffix}",
        lambda h=how, k=kw, m=model_arg: (
            collect(bulk.ForwardOutputsCollector(), h, net() if m else None, **k)
            if m
            else bulk.ForwardOutputsCollector().modules(None)
        ),
        error,
        match,
        pending,
    )
case(
    "ForwardOutputsCollector-getitem-out-of-range",
    lambda: collected(bulk.ForwardOutputsCollector())[5],
    NoRecordError,
    r"subrecorder index in \[-3, 2\].*5",
)
case(
    "ForwardOutputsCollector-getitem-str",
    lambda: collected(bulk.ForwardOutputsCollector())["fc1"],
    NoRecordError,
    r"subrecorder index.*'fc1'",
)
case(
    "ForwardOutputsCollector-samples-out-of-range",
    lambda: collected(bulk.ForwardOutputsCollector()).samples(9),
    NoRecordError,
    r"subrecorder index in \[-3, 2\].*9",
)
case(
    "ForwardOutputsCollector-remove-out-of-range",
    lambda: collected(bulk.ForwardOutputsCollector()).remove(-4),
    NoRecordError,
    r"subrecorder index in \[-3, 2\].*-4",
)
case(
    "ForwardOutputsCollector-apply-int",
    lambda: collected(bulk.ForwardOutputsCollector()).apply(5),
    RecorderConfigError,
    r"`fn`.*callable",
    None,
)
case(
    "ForwardOutputsCollector-save-to-file",
    lambda: collected(bulk.ForwardOutputsCollector()).save(garbage_file(".txt")),
    RecorderConfigError,
    r"`directory`.*(directory|folder)",
    None,
)
case(
    "load_collected-missing-directory",
    lambda: bulk.load_collected("/nonexistent/collected"),
    RecorderConfigError,
    r"`directory`.*saved with `save\(\)`",
)
case(
    "load_collected-empty-directory",
    lambda: bulk.load_collected(scratch()),
    RecorderConfigError,
    r"`directory`.*saved with `save\(\)`",
)
case(
    "load_collected-int",
    lambda: bulk.load_collected(5),
    RecorderConfigError,
    r"`directory`.*(path|saved)",
    None,
)
case(
    "load_collected-garbage-index",
    lambda: bulk.load_collected(Path(garbage_file(".json")).parent),
    RecorderConfigError,
    r"`directory`.*saved with `save\(\)`",
)

# ----------------------------------------------------------------------------------- Inspector
for suffix, kw, error, match, pending in [
    ("mode-unknown", {"mode": "test"}, RecorderConfigError, r"`mode`.*'eval'.*'test'", None),
    ("detach-str", {"detach": "yes"}, RecorderConfigError, r"`detach`.*bool", None),
    (
        "no-input",
        {"input_size": None},
        RecorderConfigError,
        r"exactly one of `input_size`.*`input_data`",
        None,
    ),
    (
        "both-inputs",
        {"input_data": X},
        RecorderConfigError,
        r"exactly one of `input_size`.*`input_data`",
        None,
    ),
    (
        "input_size-str",
        {"input_size": "1x4"},
        RecorderConfigError,
        r"`input_size`.*shape such as \(1, 5\)",
        None,
    ),
    (
        "input_size-negative",
        {"input_size": (1, -4)},
        RecorderConfigError,
        r"`input_size`.*(shape|positive)",
        None,
    ),
    (
        "input_size-zero",
        {"input_size": (0, 4)},
        RecorderConfigError,
        r"`input_size`.*(shape|positive)",
        None,
    ),
    (
        "input_size-float",
        {"input_size": (1, 4.0)},
        RecorderConfigError,
        r"`input_size`.*shape",
        None,
    ),
    (
        "input_size-wrong-for-net",
        {"input_size": (1, 5)},
        RecorderConfigError,
        r"`input_size`/`input_data`.*valid inputs of Net",
        None,
    ),
    (
        "dtypes-count",
        {"dtypes": [torch.float32, torch.float32]},
        RecorderConfigError,
        r"`dtypes`.*1 torch.dtype",
        None,
    ),
    ("dtypes-str", {"dtypes": ["float32"]}, RecorderConfigError, r"`dtypes`.*torch.dtype", None),
    (
        "dtypes-int",
        {"dtypes": 5},
        RecorderConfigError,
        r"`dtypes`.*torch.dtype",
        None,
    ),
    (
        "device-gpu",
        {"device": "gpu"},
        RecorderConfigError,
        r"`device`.*device string.*'gpu'",
        None,
    ),
    (
        "device-cuda-without-cuda",
        {"device": "cuda:0"},
        RecorderConfigError,
        r"`device`.*'cuda:0'.*(not available|no CUDA)",
        None,
    ),
    (
        "device-int-list",
        {"device": [0]},
        RecorderConfigError,
        r"`device`.*device string",
        None,
    ),
    (
        "unknown-kwarg",
        {"input_shape": (1, 4)},
        TypeError,
        r"unexpected keyword argument 'input_shape'",
        None,
    ),
]:
    if suffix == "device-cuda-without-cuda" and CUDA:
        continue
    case(f"Inspector-{suffix}", lambda k=kw: inspect_net(**k).release(), error, match, pending)
case(
    "Inspector-net-int",
    lambda: inspector.Inspector(5, input_size=(1, 4)),
    RecorderConfigError,
    r"`net`.*nn.Module.*int",
)
case(
    "Inspector-net-none",
    lambda: inspector.Inspector(None, input_size=(1, 4)),
    RecorderConfigError,
    r"`net`.*nn.Module.*NoneType",
)
case(
    "Inspector-input_data-int",
    lambda: inspector.Inspector(net(), input_data=5).release(),
    RecorderConfigError,
    r"`input_data`.*tensor, a tuple",
)
for suffix, label, error, match in [
    ("unknown-tuple", (9, 9), UnknownSourceError, r"No layer labelled 9-9.*layer labels"),
    ("unknown-str", "1-9", UnknownSourceError, r"No layer labelled 1-9.*Closest layer labels"),
    (
        "malformed-str",
        "one-two",
        RecorderConfigError,
        r"layer label such as \(1, 3\) or '1-3'.*'one-two'",
    ),
    ("int", 5, RecorderConfigError, r"layer label such as \(1, 3\) or '1-3'.*int"),
    ("none", None, RecorderConfigError, r"layer label such as \(1, 3\) or '1-3'.*NoneType"),
    ("three-tuple", (1, 1, 1), RecorderConfigError, r"layer label such as \(1, 3\).*\(1, 1, 1\)"),
]:
    case(
        f"Inspector-record-{suffix}",
        lambda lb=label: with_inspector(lambda i: i.record(lb)),
        error,
        match,
    )
case(
    "Inspector-forward-activation_postproc-int",
    lambda: with_inspector(lambda i: (i.record("1-1"), i(X, activation_postproc=5))),
    RecorderConfigError,
    r"`activation_postproc`.*callable",
)
case(
    "Inspector-forward-dont_record-str",
    lambda: with_inspector(lambda i: i(X, dont_record="yes")),
    RecorderConfigError,
    r"`dont_record`.*bool",
    None,
)

# --------------------------------------------------------------------------------------- graph
case(
    "record_graph-model-int",
    lambda: graph.record_graph(5, X),
    RecorderConfigError,
    r"`model`.*torch.nn.Module.*int",
)
case(
    "record_graph-model-none",
    lambda: graph.record_graph(None),
    RecorderConfigError,
    r"`model`.*torch.nn.Module.*NoneType",
)
case(
    "GraphRecorder-model-str",
    lambda: graph.GraphRecorder("net"),
    RecorderConfigError,
    r"`model`.*torch.nn.Module.*str",
)
case(
    "GraphRecorder-graph-before-recording",
    lambda: graph.GraphRecorder(net()).graph,
    NoRecordError,
    r"forward pass recorded inside `with GraphRecorder\(model\):`",
)
for suffix, value in [("negative", -1), ("float", 1.5), ("str", "1"), ("bool", True)]:
    case(
        f"ExecutionGraph-collapse-depth-{suffix}",
        lambda v=value: a_graph().collapse(v),
        RecorderConfigError,
        r"`depth`.*None or a non-negative integer",
    )
    case(
        f"ExecutionGraph-to_dot-depth-{suffix}",
        lambda v=value: a_graph().to_dot(depth=v),
        RecorderConfigError,
        r"`depth`.*None or a non-negative integer",
    )
case(
    "ExecutionGraph-node-unknown",
    lambda: a_graph().node("fc9"),
    UnknownSourceError,
    r"node id of the graph.*'fc9'",
)
case(
    "ExecutionGraph-children-unknown",
    lambda: a_graph().children("fc9"),
    UnknownSourceError,
    r"node id of the graph.*'fc9'",
)
case(
    "ExecutionGraph-successors-unknown",
    lambda: a_graph().successors("fc9"),
    UnknownSourceError,
    r"node id of the graph.*'fc9'",
)
case(
    "ExecutionGraph-predecessors-int",
    lambda: a_graph().predecessors(5),
    UnknownSourceError,
    r"node id of the graph.*5",
    None,
)
case(
    "ExecutionGraph-find-kind-unknown",
    lambda: a_graph().find(kind="layer"),
    RecorderConfigError,
    r"`kind`.*'module'.*'layer'",
)
case(
    "ExecutionGraph-render-suffix-mismatch",
    lambda: a_graph().render("graph.png", format="svg"),
    RecorderConfigError,
    r"suffix of `path`.*`format` 'svg'",
)
case(
    "ExecutionGraph-render-format-unknown",
    lambda: a_graph().render("graph.bmp2", format="bmp2"),
    RecorderConfigError,
    r"`format`.*'svg'.*'bmp2'",
)
case(
    "ExecutionGraph-from_dict-missing-edges",
    lambda: graph.ExecutionGraph.from_dict({"nodes": []}),
    RecorderConfigError,
    r"'nodes' and 'edges'.*\['nodes'\]",
)
case(
    "ExecutionGraph-from_dict-bad-node",
    lambda: graph.ExecutionGraph.from_dict({"nodes": [{"id": "a"}], "edges": []}),
    RecorderConfigError,
    r"node fields.*\['id'\]",
)
case(
    "ExecutionGraph-from_dict-int",
    lambda: graph.ExecutionGraph.from_dict(5),
    RecorderConfigError,
    r"mapping with 'nodes' and 'edges'.*int",
    None,
)


def node(
    id: str, kind: Any = "module", depth: int = 0, parent: str | None = None
) -> graph.GraphNode:
    return graph.GraphNode(id=id, kind=kind, name=id, label=id, depth=depth, parent=parent)


case(
    "ExecutionGraph-duplicate-node",
    lambda: graph.ExecutionGraph([node("a"), node("a")], []),
    RecorderConfigError,
    r"unique node ids.*'a' twice",
)
case(
    "ExecutionGraph-node-kind-unknown",
    lambda: graph.ExecutionGraph([node("a", kind="layer")], []),
    RecorderConfigError,
    r"node kind.*'module'.*'layer'",
)
case(
    "ExecutionGraph-parent-unknown",
    lambda: graph.ExecutionGraph([node("a", depth=1, parent="z")], []),
    RecorderConfigError,
    r"parent of 'a'.*node of the graph.*'z'",
)
case(
    "ExecutionGraph-depth-inconsistent",
    lambda: graph.ExecutionGraph([node("p"), node("a", depth=3, parent="p")], []),
    RecorderConfigError,
    r"'a' to have depth 1",
)
case(
    "ExecutionGraph-edge-unknown-node",
    lambda: graph.ExecutionGraph([node("a")], [("a", "z")]),
    RecorderConfigError,
    r"edge \('a', 'z'\).*nodes of the graph",
)

# ------------------------------------------------------------------------------------ delivery
for cls_name, cls, good in (
    ("FunctionOutputsDelivery", lr.FunctionOutputsDelivery, "helpers.toy.double"),
    ("MethodOutputsDelivery", lr.MethodOutputsDelivery, "helpers.toy.Toy.scale"),
):
    for suffix, value in [
        ("zero", 0),
        ("negative", -1),
        ("float", 1.5),
        ("bool", True),
        ("none", None),
    ]:
        case(
            f"{cls_name}-max_keep_data-{suffix}",
            lambda c=cls, g=good, v=value: c(g, max_keep_data=v),
            RecorderConfigError,
            r"`max_keep_data`.*positive int",
        )
    case(
        f"{cls_name}-source-int", lambda c=cls: c(5), RecorderConfigError, r"`source`.*dotted path"
    )
    case(
        f"{cls_name}-source-unimportable",
        lambda c=cls: c("no_such_package.a.b"),
        InvalidSourceError,
        r"`source`.*importable module",
    )
    case(
        f"{cls_name}-unknown-kwarg",
        lambda c=cls, g=good: c(g, max_keep=2),
        TypeError,
        r"unexpected keyword argument 'max_keep'",
    )
    case(
        f"{cls_name}-override_data-str",
        lambda c=cls, g=good: setattr(c(g), "override_data", "yes"),
        RecorderConfigError,
        r"`override_data`.*bool",
    )
case(
    "FunctionOutputsDelivery-source-is-a-method",
    lambda: lr.FunctionOutputsDelivery("helpers.toy.Toy.scale"),
    InvalidSourceError,
    r"'helpers.toy.Toy.scale'.*function",
)
case(
    "MethodOutputsDelivery-source-is-a-function",
    lambda: lr.MethodOutputsDelivery("helpers.toy.add"),
    InvalidSourceError,
    r"'helpers.toy.add'.*method",
)
case(
    "MethodOutputsDelivery-source-builtin-type-method",
    lambda: init_delivery(lr.MethodOutputsDelivery("builtins.str.upper")),
    InvalidSourceError,
    r"`source`.*'builtins.str.upper'.*(builtin|C type|cannot be patched)",
    None,
)
case(
    "DistillDelivery-base-class",
    lambda: lr.DistillDelivery("helpers.toy.double"),
    RecorderConfigError,
    r"concrete delivery.*FunctionOutputsDelivery",
)
for suffix, value, error, match, pending in [
    (
        "int",
        5,
        RecorderConfigError,
        r"`deliveries`.*mapping.*int",
        None,
    ),
    ("config-int", {"d": 5}, RecorderConfigError, r"delivery 'd'.*mapping", None),
    (
        "unknown-type",
        {"d": {"type": "Functions", "source": "helpers.toy.double"}},
        RecorderConfigError,
        r"Unknown delivery type 'Functions' in delivery 'd'.*'FunctionOutputs'",
        None,
    ),
    (
        "no-source",
        {"d": {"type": "FunctionOutputs"}},
        RecorderConfigError,
        r"delivery 'd'.*'source'",
        None,
    ),
    (
        "duplicate-name",
        [("d", {"type": "FunctionOutputs", "source": "helpers.toy.double"})] * 2,
        DuplicateNameError,
        r"delivery named 'd' already exists.*names must be unique",
        None,
    ),
    (
        "unknown-option",
        {"d": {"type": "FunctionOutputs", "source": "helpers.toy.double", "max_keep": 2}},
        RecorderConfigError,
        r"'max_keep'.*Closest options: 'max_keep_data'",
        None,
    ),
]:
    case(
        f"DistillDeliveryManager-{suffix}",
        lambda v=value: lr.DistillDeliveryManager(v),
        error,
        match,
        pending,
    )
case(
    "DistillDeliveryManager-get_delivery-unknown",
    lambda: lr.DistillDeliveryManager(
        {"dbl": {"type": "FunctionOutputs", "source": "helpers.toy.double"}}
    ).get_delivery("dlb"),
    RecorderConfigError,
    r"'dlb'.*Closest delivery names: 'dbl'",
)

# -------------------------------------------------------------------------------- ShardWriter
for suffix, value in [("int", 5), ("none", None), ("list", ["dtype"])]:
    case(
        f"ShardWriter-sources-options-{suffix}",
        lambda v=value: ShardWriter(scratch(), sources={"hidden": v}),
        RecorderConfigError,
        r"options of source 'hidden' to be a dict such as \{'dtype': 'float16'\}",
    )

# ----------------------------------------------------------------------------------- Arguments
case(
    "Arguments-getitem-unknown-name",
    lambda: lr.Arguments((1, 2), ("a", "b"))["c"],
    RecorderError,
    r"No argument named 'c'.*a, b",
    None,
)
case(
    "Arguments-names-length-mismatch",
    lambda: lr.Arguments((1, 2), ("a",)),
    RecorderConfigError,
    r"`names`.*2.*1",
    None,
)


# ------------------------------------------------------------------------------------ the test
def _params() -> Iterator[Any]:
    for c in CASES:
        marks = []
        if c.pending is not None:
            marks.append(pytest.mark.xfail(strict=True, reason=c.pending))
        if "cuda-without-cuda" in c.id and CUDA:
            marks.append(pytest.mark.skip(reason="CUDA is available here: 'cuda:0' is valid"))
        yield pytest.param(c, id=c.id, marks=marks)


@pytest.fixture(autouse=True)
def _fresh_models() -> Iterator[None]:
    MODELS.clear()
    yield
    MODELS.clear()


@pytest.mark.parametrize("bad", list(_params()))
def test_bad_input_raises_a_clear_error(bad: Case) -> None:
    with pytest.raises(bad.error, match=bad.match) as info:
        bad.build()
    if bad.error is not TypeError:
        assert isinstance(info.value, RecorderError), (
            f"{type(info.value).__name__} is not a RecorderError"
        )
    left = [f"{type(m).__name__}: {h}" for m in MODELS for h in hooks_left(m)]
    assert not left, f"hooks left on the model: {left}"


def test_the_table_is_large_and_its_ids_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 250, len(ids)
    assert all(c.pending is None or c.pending.startswith("pending: ") for c in CASES)


def test_every_error_class_is_a_recorder_error() -> None:
    for c in CASES:
        assert c.error is TypeError or issubclass(c.error, RecorderError), c.id


def test_global_norm_of_nothing_is_zero() -> None:
    # Decision: the norm of an empty set is 0 (as torch.nn.utils.clip_grad_norm_ gives), so a
    # generator of gradients that yields nothing before the first backward reads 0, not an error.
    assert stats.global_norm([]).item() == 0.0
    assert stats.global_norm(p.grad for p in net().parameters() if p.grad is not None) == 0.0


# A decision the table relies on: a glob over parameters skips the frozen ones (it selects what
# can have a gradient); a frozen parameter named exactly is an error (see the table above).
def test_parameter_grad_glob_skips_frozen_parameters() -> None:
    model = net(frozen=("fc1.weight",))
    recorder = lr.ParameterGradRecorder("*.weight")
    try:
        recorder.initialize(model)
        with recorder:
            model(X).sum().backward()
        assert sorted(recorder.streams) == ["fc2.weight"]
        torch.testing.assert_close(  # the same tensor is recorded: exact
            recorder.get_record_data(source="fc2.weight"), model.fc2.weight.grad, rtol=0, atol=0
        )
    finally:
        recorder.release()
    assert not hooks_left(model)
