"""The Lightning callbacks: the only room of the package that imports Lightning.

* :mod:`.recorder` — :class:`RecorderCallback`: recorders driven by the Trainer's loops;
* :mod:`.stats_monitor` — :class:`FeatureStatsMonitor`: feature, parameter and gradient
  statistics logged every N steps (built on :class:`RecorderCallback`);
* :mod:`.distillation` — :class:`FeatureDistillation`: a frozen teacher distilled into the student;
* :mod:`.activation_writer` — :class:`ActivationWriter`: recorded outputs written to sharded
  safetensors files with their provenance (``lightning_recorder.activations`` reads them back);
* :mod:`.tensorboard_logger` — :class:`TensorBoardLogger`: Lightning's TensorBoard logger with
  its event file checksummed in C.
* :mod:`.health` — :class:`HealthMonitor`: the first NaN/Inf of a run traced to the module that
  made it (a :class:`HealthEvent`), with evidence on disk, and bad steps skipped alike on every
  rank; rules (:class:`HealthRule` and those that ship) that name dead, saturated or exploding
  layers, and a view of every layer at a glance.

``_lightning`` holds every read of Lightning's private state, so that a change in Lightning
touches one file.
"""

from .activation_writer import ActivationWriter
from .distillation import FeatureDistillation, LossSpec, TeacherInput, distillation_loss
from .health import (
    DeadUnitsRule,
    ExplodingGradientsRule,
    HealthEvent,
    HealthMonitor,
    HealthRule,
    LossSpikeRule,
    RuleInput,
    SaturationRule,
    UpdateRatioRule,
    VanishingGradientsRule,
)
from .recorder import RecorderCallback
from .stats_monitor import FeatureStatsMonitor, StatsReport
from .tensorboard_logger import TensorBoardLogger

__all__ = [
    "ActivationWriter",
    "DeadUnitsRule",
    "ExplodingGradientsRule",
    "FeatureDistillation",
    "FeatureStatsMonitor",
    "HealthEvent",
    "HealthMonitor",
    "HealthRule",
    "LossSpec",
    "LossSpikeRule",
    "RecorderCallback",
    "RuleInput",
    "SaturationRule",
    "StatsReport",
    "TeacherInput",
    "TensorBoardLogger",
    "UpdateRatioRule",
    "VanishingGradientsRule",
    "distillation_loss",
]
