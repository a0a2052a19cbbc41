"""Activation datasets: recorded activations written to sharded files, and read back.

This room depends on torch only (no Lightning, no recorder import): it takes tensors, or anything
with a :class:`~lightning_recorder.RecorderManager`'s ``streams()``. The Lightning callback
``ActivationWriter`` drives it from a ``Trainer``; a plain PyTorch loop drives it directly::

    manager = RecorderManager({"feat": {"type": "ModuleOutputs", "source": "fc1",
                                        "detach": True}})
    manager.initialize(model)
    with ShardWriter("acts/", run="probe") as writer:
        for batch_idx, (x, index) in enumerate(loader):
            with manager:
                model(x)
            writer.write_records(manager, stage="predict", batch_idx=batch_idx,
                                 sample_index=index)
    manager.release()
    features = concat_activations("acts/", "feat")

* :class:`ShardWriter` — a background thread behind a bounded queue writes the tensors to
  safetensors shards that roll over at a size limit; each shard gets a small JSON index file,
  written after the shard, so the index files list exactly the complete shards.
* :class:`ActivationDataset` — a map-style ``Dataset`` of the rows (memory-mapped), filtered by
  run, stage, step, epoch, rank, module, source; :func:`concat_activations` makes one tensor.

The format (file names, tensor names, index fields) is specified in :mod:`._format` and in the
documentation page "Activation datasets"; the files open without this package with
``safetensors`` and ``json``. Shards are written and read by safetensors' own API.
"""

from ._dataset import ActivationDataset, concat_activations
from ._format import FORMAT, VERSION
from ._writer import ShardWriter

__all__ = ["FORMAT", "VERSION", "ActivationDataset", "ShardWriter", "concat_activations"]
