"""The public API: what `from lightning_recorder import ...` offers, pinned."""

from __future__ import annotations

import subprocess
import sys

import lightning_recorder

EXPECTED = [
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


def test_all_is_pinned_and_importable() -> None:
    assert lightning_recorder.__all__ == EXPECTED
    for name in EXPECTED:
        assert getattr(lightning_recorder, name) is not None


def test_recorder_core_does_not_import_lightning() -> None:
    code = (
        "import sys\n"
        "import lightning_recorder.manager, lightning_recorder.module_recorders\n"
        "import lightning_recorder.function_recorders, lightning_recorder.parameter_recorders\n"
        "assert 'lightning' not in sys.modules, 'the core imported lightning'\n"
    )
    # The package __init__ imports the callbacks, so import the core modules without it.
    stub = (
        "import importlib.util, sys, types, pathlib\n"
        "import torch\n"
        "spec = importlib.util.find_spec('lightning_recorder')\n"
        "pkg = types.ModuleType('lightning_recorder')\n"
        "pkg.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['lightning_recorder'] = pkg\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", stub + code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
