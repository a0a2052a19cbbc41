"""Reading a W&B offline run back (the package never reads them): its history records.

W&B (0.31) writes an offline run as a ``.wandb`` file: a 7-byte header, then LevelDB-style log
blocks of 32 KiB whose records are ``wandb_internal_pb2.Record`` protobufs. W&B's service process
writes it, and may still be writing when ``wandb.finish`` returns (on a loaded machine):
:func:`wait_for_history` reads it again until the records a test expects are there, and a
reader never takes a record the writer has not finished (a missing file, a torn last record).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # b":W&B", a 2-byte magic, a 1-byte version


def records(path: Path) -> list[bytes]:
    """The payloads of a ``.wandb`` log file (FULL, or FIRST/MIDDLE/LAST fragments joined), up to
    the last whole record (the writer may be in the middle of the next)."""
    data = path.read_bytes()
    if len(data) < HEADER:  # created, header not written yet
        return []
    assert data[:4] == b":W&B", data[:8]
    out: list[bytes] = []
    pos, parts = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if pos + 7 + length > len(data):  # torn: the rest is still being written
            break
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(payload)
        elif kind in (2, 3):
            parts += payload
        elif kind == 4:
            out.append(parts + payload)
            parts = b""
    return out


def history(run_dir: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2

    found = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    if not found:  # the service has not created it yet
        return []
    (path,) = found
    rows = []
    for payload in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def wait_for_history(
    run_dir: Path, ready: Callable[[list[dict[str, Any]]], bool], timeout: float = 60.0
) -> list[dict[str, Any]]:
    """The history rows of the offline run under ``run_dir`` once ``ready(rows)`` holds, read
    again every half second for up to ``timeout`` seconds (then the last rows read, for the
    test's assertions to report)."""
    deadline = time.monotonic() + timeout
    rows = history(run_dir)
    while not ready(rows) and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = history(run_dir)
    return rows
