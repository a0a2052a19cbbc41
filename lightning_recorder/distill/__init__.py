"""Distillation maths, usable without Lightning: losses, connectors and deliveries.

* :mod:`.losses` — feature-matching losses (MSE/FitNets, L1, cosine, attention transfer, KL on
  logits) as functions and modules, and :func:`get_loss`, which resolves a loss by name;
* :mod:`.connectors` — the learned layers that bring a student's features to the teacher's
  shape (:func:`build_connector`, :func:`resolve_connector`);
* :mod:`.delivery` — MMRazor's deliveries: record what a function returns in the teacher's pass
  and replay it in the student's.

The Lightning callback that puts them to work, :class:`~lightning_recorder.FeatureDistillation`,
lives in ``lightning_recorder.callbacks.distillation``.
"""

from .connectors import ConnectorSpec, build_connector, resolve_connector
from .delivery import (
    DistillDelivery,
    DistillDeliveryManager,
    FunctionOutputsDelivery,
    MethodOutputsDelivery,
    build_delivery,
)
from .losses import (
    AttentionTransferLoss,
    CosineLoss,
    KLDivLoss,
    L1Loss,
    LossFn,
    MSELoss,
    attention_transfer_loss,
    cosine_loss,
    get_loss,
    kl_div_loss,
    l1_loss,
    mse_loss,
)

__all__ = [
    "AttentionTransferLoss",
    "ConnectorSpec",
    "CosineLoss",
    "DistillDelivery",
    "DistillDeliveryManager",
    "FunctionOutputsDelivery",
    "KLDivLoss",
    "L1Loss",
    "LossFn",
    "MSELoss",
    "MethodOutputsDelivery",
    "attention_transfer_loss",
    "build_connector",
    "build_delivery",
    "cosine_loss",
    "get_loss",
    "kl_div_loss",
    "l1_loss",
    "mse_loss",
    "resolve_connector",
]
