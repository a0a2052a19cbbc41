"""Record what happens inside a PyTorch model while it trains."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._core.structures import Arguments
from .activations import ActivationDataset, ShardWriter, concat_activations
from .bulk import (
    CollectedRecord,
    ForwardInputsCollector,
    ForwardOutputsCollector,
    OutputGradsCollector,
    load_collected,
)
from .distill import (
    AttentionTransferLoss,
    CosineLoss,
    DistillDelivery,
    DistillDeliveryManager,
    FunctionOutputsDelivery,
    KLDivLoss,
    L1Loss,
    MethodOutputsDelivery,
    MSELoss,
    attention_transfer_loss,
    build_connector,
    cosine_loss,
    get_loss,
    kl_div_loss,
    l1_loss,
    mse_loss,
    resolve_connector,
)
from .errors import (
    DuplicateNameError,
    InvalidSourceError,
    NonFiniteError,
    NoRecordError,
    NotInitializedError,
    RecorderConfigError,
    RecorderError,
    RecorderStateError,
    RecordModifiedError,
    UnknownRecorderTypeError,
    UnknownSourceError,
)
from .graph import ExecutionGraph, GraphEdge, GraphNode, GraphRecorder, record_graph
from .inspector import Inspector
from .recorders import (
    BaseRecorder,
    FunctionInputsRecorder,
    FunctionOutputsRecorder,
    MethodInputsRecorder,
    MethodOutputsRecorder,
    ModuleInputGradsRecorder,
    ModuleInputsRecorder,
    ModuleOutputGradsRecorder,
    ModuleOutputsRecorder,
    ParameterGradRecorder,
    ParameterRecorder,
    RecorderManager,
    RecordStream,
    build_recorder,
    recorder_types,
    register_recorder,
)
from .stats import (
    STAT_NAMES,
    feature_stats,
    global_norm,
    histogram,
    histogram_raw_kwargs,
    tensor_norm,
    update_ratio,
)

if TYPE_CHECKING:  # resolved lazily below: they import Lightning or torchmetrics
    from .callbacks import (
        ActivationWriter,
        DeadUnitsRule,
        ExplodingGradientsRule,
        FeatureDistillation,
        FeatureStatsMonitor,
        HealthEvent,
        HealthMonitor,
        HealthRule,
        LossSpikeRule,
        RecorderCallback,
        RuleInput,
        SaturationRule,
        TeacherInput,
        TensorBoardLogger,
        UpdateRatioRule,
        VanishingGradientsRule,
        distillation_loss,
    )
    from .stats import FeatureStats

#: Names whose modules import Lightning or torchmetrics, and where they live.
_LAZY = {
    "ActivationWriter": "lightning_recorder.callbacks",
    "FeatureDistillation": "lightning_recorder.callbacks",
    "FeatureStatsMonitor": "lightning_recorder.callbacks",
    "HealthEvent": "lightning_recorder.callbacks",
    "HealthMonitor": "lightning_recorder.callbacks",
    "RecorderCallback": "lightning_recorder.callbacks",
    "TeacherInput": "lightning_recorder.callbacks",
    "TensorBoardLogger": "lightning_recorder.callbacks",
    "distillation_loss": "lightning_recorder.callbacks",
    "DeadUnitsRule": "lightning_recorder.callbacks",
    "ExplodingGradientsRule": "lightning_recorder.callbacks",
    "HealthRule": "lightning_recorder.callbacks",
    "LossSpikeRule": "lightning_recorder.callbacks",
    "RuleInput": "lightning_recorder.callbacks",
    "SaturationRule": "lightning_recorder.callbacks",
    "UpdateRatioRule": "lightning_recorder.callbacks",
    "VanishingGradientsRule": "lightning_recorder.callbacks",
    "FeatureStats": "lightning_recorder.stats.metric",
}


def __getattr__(name: str) -> Any:
    # PEP 562: the callbacks (Lightning) and FeatureStats (torchmetrics) load on first use, so
    # that `import lightning_recorder` costs little more than `import torch`.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0.dev0"

__all__ = [
    "STAT_NAMES",
    "ActivationDataset",
    "ActivationWriter",
    "Arguments",
    "AttentionTransferLoss",
    "BaseRecorder",
    "CollectedRecord",
    "CosineLoss",
    "DeadUnitsRule",
    "DistillDelivery",
    "DistillDeliveryManager",
    "DuplicateNameError",
    "ExecutionGraph",
    "ExplodingGradientsRule",
    "FeatureDistillation",
    "FeatureStats",
    "FeatureStatsMonitor",
    "ForwardInputsCollector",
    "ForwardOutputsCollector",
    "FunctionInputsRecorder",
    "FunctionOutputsDelivery",
    "FunctionOutputsRecorder",
    "GraphEdge",
    "GraphNode",
    "GraphRecorder",
    "HealthEvent",
    "HealthMonitor",
    "HealthRule",
    "Inspector",
    "InvalidSourceError",
    "KLDivLoss",
    "L1Loss",
    "LossSpikeRule",
    "MSELoss",
    "MethodInputsRecorder",
    "MethodOutputsDelivery",
    "MethodOutputsRecorder",
    "ModuleInputGradsRecorder",
    "ModuleInputsRecorder",
    "ModuleOutputGradsRecorder",
    "ModuleOutputsRecorder",
    "NoRecordError",
    "NonFiniteError",
    "NotInitializedError",
    "OutputGradsCollector",
    "ParameterGradRecorder",
    "ParameterRecorder",
    "RecordModifiedError",
    "RecordStream",
    "RecorderCallback",
    "RecorderConfigError",
    "RecorderError",
    "RecorderManager",
    "RecorderStateError",
    "RuleInput",
    "SaturationRule",
    "ShardWriter",
    "TeacherInput",
    "TensorBoardLogger",
    "UnknownRecorderTypeError",
    "UnknownSourceError",
    "UpdateRatioRule",
    "VanishingGradientsRule",
    "__version__",
    "attention_transfer_loss",
    "build_connector",
    "build_recorder",
    "concat_activations",
    "cosine_loss",
    "distillation_loss",
    "feature_stats",
    "get_loss",
    "global_norm",
    "histogram",
    "histogram_raw_kwargs",
    "kl_div_loss",
    "l1_loss",
    "load_collected",
    "mse_loss",
    "record_graph",
    "recorder_types",
    "register_recorder",
    "resolve_connector",
    "tensor_norm",
    "update_ratio",
]
