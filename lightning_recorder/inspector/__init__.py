"""`Inspector`: a network wrapped with a labelled summary and per-layer recording.

The inspector runs one traced forward when it is built, labels every module call ``depth-idx``
(the labels torchinfo shows), and records the outputs ("activations") of the layers chosen by
label in each later forward; it can also post-process those outputs on the fly::

    inspector = Inspector(net, input_size=(1, 5))
    print(inspector)                    # the summary table
    inspector.record((1, 3), "0-1")     # by (depth, idx) or "depth-idx"
    out = inspector(x)                  # forwards to `net`, records
    inspector.activations[(1, 3)]       # the output of layer 1-3 in that forward
    inspector.release()                 # every hook removed
"""

from ._inspector import Inspector, LabelMap, Postprocessor
from ._trace import LayerRow

__all__ = ["Inspector", "LabelMap", "LayerRow", "Postprocessor"]
