"""Recorders: MMRazor's recorder vocabulary, and the manager that builds them from dicts.

A recorder names a *source* — a module, a function or method by dotted path, a parameter — is
*initialized* once against a model (hooks or patches installed, inactive), and records only inside
its context. Follow a ``source`` from a config dict to the hook that fires without leaving this
room:

* :mod:`.manager` — :class:`RecorderManager` turns ``{"name": {"type": ..., "source": ...}}``
  into recorders through the registry in ``_registry`` (:func:`build_recorder`);
* :mod:`.module`, :mod:`.function`, :mod:`.parameter` — the recorder kinds: each
  ``prepare_from_model`` resolves its source (``_core.names.select`` for modules and parameters,
  ``_core.patching.resolve`` for functions) and installs its hooks;
* :mod:`.base` — :class:`BaseRecorder` (lifecycle, options, streams), :class:`RecordStream`
  and :class:`RecorderHook`, the base of every recorder hook.

Importing this room registers every built-in recorder type.
"""

from ._registry import build_recorder, recorder_types, register_recorder
from .base import BaseRecorder, Keep, RecorderHook, RecordStream
from .function import (
    FunctionInputsRecorder,
    FunctionOutputsRecorder,
    MethodInputsRecorder,
    MethodOutputsRecorder,
)
from .manager import RecorderManager
from .module import (
    ModuleInputGradsRecorder,
    ModuleInputsRecorder,
    ModuleOutputGradsRecorder,
    ModuleOutputsRecorder,
)
from .parameter import ParameterGradRecorder, ParameterRecorder

__all__ = [
    "BaseRecorder",
    "FunctionInputsRecorder",
    "FunctionOutputsRecorder",
    "Keep",
    "MethodInputsRecorder",
    "MethodOutputsRecorder",
    "ModuleInputGradsRecorder",
    "ModuleInputsRecorder",
    "ModuleOutputGradsRecorder",
    "ModuleOutputsRecorder",
    "ParameterGradRecorder",
    "ParameterRecorder",
    "RecordStream",
    "RecorderHook",
    "RecorderManager",
    "build_recorder",
    "recorder_types",
    "register_recorder",
]
