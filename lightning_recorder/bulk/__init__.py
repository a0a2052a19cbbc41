"""Bulk collectors: record many modules at once, chosen by type and/or position.

A collector registers one *subrecorder* per chosen module of ``model.modules()`` (recursive, the
model itself first) or ``model.children()`` (direct children only) and keeps, per subrecorder,
either the list of recorded samples or their running fold (``reduction``)::

    collector = ForwardOutputsCollector(reduction=lambda acc, x: acc + x)
    collector.children(model, types=nn.Linear)   # one subrecorder per Linear child
    model(x); model(y)
    collector[0]            # sum of the first Linear's outputs over both calls
    collector.release()     # every hook removed; the data stays readable

Subrecorders are indexed in registration order (the iteration order of ``modules()`` or
``children()``), whatever the order in which the modules run. Unlike the recorders, collectors need
no ``with`` context: they record from registration until ``release()`` (or the end of a
``with collector:`` block).

Options shared by every collector (keyword arguments; ``condition`` and ``reduction`` may also
be given by position, as in torchfunc):

* ``condition``: a zero-argument callable; a sample is recorded only when it returns true
  (e.g. ``lambda: label == 3``). ``None`` records every call.
* ``reduction``: a two-argument fold ``reduction(accumulated, sample)`` (e.g.
  ``lambda acc, x: acc + x``) replacing the list of samples by one value; the first
  sample is copied so the fold never writes into the model's tensors.
* ``detach``: record ``tensor.detach()`` (default ``True``: statistics do not keep the
  autograd graph alive).
* ``clone``: record a copy, immune to later in-place changes of the original. Without it, a
  sample changed in place (e.g. by ``ReLU(inplace=True)``) raises
  :class:`~lightning_recorder.RecordModifiedError` when read.
* ``device``: move recorded tensors to this device (e.g. ``"cpu"``).
* ``dtype``: cast recorded floating-point tensors to this dtype.
* ``path``: what to record from a structured value: a position, an argument name, a key or a
  field, or a dotted chain (default: see the collector).
* ``data_method``: torchfunc's choice of what a sample is: ``"sample"`` (the first item of the
  data: ``inputs[0]``, a tensor output's first row, the output gradient) or ``"batch"`` (all of
  it: the inputs tuple, the whole output, the ``(grad,)`` tuple). ``None`` (default) keeps the
  collector's own pick; exclusive with ``path``; ``set_data_method`` switches it later.
"""

from ._collector import (
    BackwardOutput,
    CollectedRecord,
    ForwardInputsCollector,
    ForwardOutput,
    ForwardOutputsCollector,
    ForwardPre,
    OutputGradsCollector,
    load_collected,
)

__all__ = [
    "BackwardOutput",
    "CollectedRecord",
    "ForwardInputsCollector",
    "ForwardOutput",
    "ForwardOutputsCollector",
    "ForwardPre",
    "OutputGradsCollector",
    "load_collected",
]
