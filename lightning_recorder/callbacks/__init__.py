"""The Lightning callbacks: the only room of the package that imports Lightning.

* :mod:`.recorder` — :class:`RecorderCallback`: recorders driven by the Trainer's loops;
* :mod:`.stats_monitor` — :class:`FeatureStatsMonitor`: feature, parameter and gradient
  statistics logged every N steps (built on :class:`RecorderCallback`);
* :mod:`.distillation` — :class:`FeatureDistillation`: a frozen teacher distilled into the student.

``_lightning`` holds every read of Lightning's private state, so that a change in Lightning
touches one file.
"""

from .distillation import FeatureDistillation, LossSpec, distillation_loss
from .recorder import RecorderCallback
from .stats_monitor import FeatureStatsMonitor

__all__ = [
    "FeatureDistillation",
    "FeatureStatsMonitor",
    "LossSpec",
    "RecorderCallback",
    "distillation_loss",
]
