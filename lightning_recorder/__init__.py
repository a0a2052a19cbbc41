"""Record what happens inside a PyTorch model while it trains."""

from ._structures import Arguments
from .base import BaseRecorder, RecordStream
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
from .manager import RecorderManager, build_recorder, recorder_types, register_recorder
from .module_recorders import (
    ModuleInputGradsRecorder,
    ModuleInputsRecorder,
    ModuleOutputGradsRecorder,
    ModuleOutputsRecorder,
)
from .parameter_recorders import ParameterGradRecorder, ParameterRecorder

__version__ = "0.1.0.dev0"

__all__ = [
    "Arguments",
    "BaseRecorder",
    "DuplicateNameError",
    "FunctionInputsRecorder",
    "FunctionOutputsRecorder",
    "InvalidSourceError",
    "MethodInputsRecorder",
    "MethodOutputsRecorder",
    "ModuleInputGradsRecorder",
    "ModuleInputsRecorder",
    "ModuleOutputGradsRecorder",
    "ModuleOutputsRecorder",
    "NoRecordError",
    "NotInitializedError",
    "ParameterGradRecorder",
    "ParameterRecorder",
    "RecordModifiedError",
    "RecordStream",
    "RecorderConfigError",
    "RecorderError",
    "RecorderManager",
    "RecorderStateError",
    "UnknownRecorderTypeError",
    "UnknownSourceError",
    "__version__",
    "build_recorder",
    "recorder_types",
    "register_recorder",
]
