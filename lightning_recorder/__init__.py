"""Record what happens inside a PyTorch model while it trains."""

from ._structures import Arguments
from .base import BaseRecorder, RecordStream
from .bulk import (
    CollectedRecord,
    ForwardInputsCollector,
    ForwardOutputsCollector,
    OutputGradsCollector,
    load_collected,
)
from .callback import RecorderCallback
from .connectors import build_connector, resolve_connector
from .delivery import (
    DistillDelivery,
    DistillDeliveryManager,
    FunctionOutputsDelivery,
    MethodOutputsDelivery,
)
from .distillation import FeatureDistillation, distillation_loss
from .errors import (
    DuplicateNameError,
    InvalidSourceError,
    NoRecordError,
    NotInitializedError,
    RecorderConfigError,
    RecorderError,
    RecorderStateError,
    RecordModifiedError,
    UnknownRecorderTypeError,
    UnknownSourceError,
)
from .function_recorders import (
    FunctionInputsRecorder,
    FunctionOutputsRecorder,
    MethodInputsRecorder,
    MethodOutputsRecorder,
)
from .graph import ExecutionGraph, GraphEdge, GraphNode, GraphRecorder, record_graph
from .inspector import Inspector
from .losses import (
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
from .manager import RecorderManager, build_recorder, recorder_types, register_recorder
from .module_recorders import (
    ModuleInputGradsRecorder,
    ModuleInputsRecorder,
    ModuleOutputGradsRecorder,
    ModuleOutputsRecorder,
)
from .parameter_recorders import ParameterGradRecorder, ParameterRecorder
from .stats import (
    STAT_NAMES,
    FeatureStats,
    feature_stats,
    global_norm,
    histogram,
    histogram_raw_kwargs,
    tensor_norm,
    update_ratio,
)
from .stats_monitor import FeatureStatsMonitor

__version__ = "0.1.0.dev0"

__all__ = [
    "STAT_NAMES",
    "Arguments",
    "AttentionTransferLoss",
    "BaseRecorder",
    "CollectedRecord",
    "CosineLoss",
    "DistillDelivery",
    "DistillDeliveryManager",
    "DuplicateNameError",
    "ExecutionGraph",
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
    "Inspector",
    "InvalidSourceError",
    "KLDivLoss",
    "L1Loss",
    "MSELoss",
    "MethodInputsRecorder",
    "MethodOutputsDelivery",
    "MethodOutputsRecorder",
    "ModuleInputGradsRecorder",
    "ModuleInputsRecorder",
    "ModuleOutputGradsRecorder",
    "ModuleOutputsRecorder",
    "NoRecordError",
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
    "UnknownRecorderTypeError",
    "UnknownSourceError",
    "__version__",
    "attention_transfer_loss",
    "build_connector",
    "build_recorder",
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
