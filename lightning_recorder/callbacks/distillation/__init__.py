"""`FeatureDistillation` and its machinery: a family of private parts behind one callback.

* ``callback`` — :class:`FeatureDistillation` (the Lightning hooks) and :func:`distillation_loss`;
* ``_step`` — one training step: record the student, run the teacher on the student's inputs,
  compute the terms;
* ``_patch`` — the instance patch of ``training_step`` and the student-input hook;
* ``_bank`` — the connectors, their optimizer group, checkpointing and DDP gradient sync;
* ``_config`` — argument checks and per-pair expansion.
"""

from ._config import LossSpec
from .callback import FeatureDistillation, TeacherInput, distillation_loss

__all__ = ["FeatureDistillation", "LossSpec", "TeacherInput", "distillation_loss"]
