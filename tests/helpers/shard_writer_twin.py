"""One of two processes that write the same run and rank into one directory, taking turns.

``write_in_turns`` is the target of a ``multiprocessing`` spawn process: its turns are batches
``role``, ``role + 2``, ... (each a shard); after each turn both writers wait twice at a barrier
shared with the test, which looks at the directory in between.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_recorder.activations import ShardWriter

TIMEOUT = 120.0  # seconds a process waits at the barrier for the others


def batch(i: int) -> tuple[torch.Tensor, list[int]]:
    """Batch ``i``: two rows of the value ``i``, samples ``2 i`` and ``2 i + 1``."""
    return torch.full((2, 3), float(i)), [2 * i, 2 * i + 1]


def write_in_turns(directory: str, role: int, turns: int, barrier: Any, queue: Any) -> None:
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ShardWriter(directory, run="twin", max_shard_bytes=1) as writer:
            for turn in range(turns):
                if turn % 2 == role:
                    rows, index = batch(turn)
                    writer.write("s", "m", rows, batch_idx=turn, sample_index=index)
                    writer.flush()
                barrier.wait(TIMEOUT)  # the turn is written
                barrier.wait(TIMEOUT)  # the test has looked at the directory
    queue.put((role, [str(w.message) for w in caught]))
