"""Reading a W&B offline run back (the package never reads them): its history records.

W&B (0.31) writes an offline run as a ``.wandb`` file: a 7-byte header, then LevelDB-style log
blocks of 32 KiB whose records are ``wandb_internal_pb2.Record`` protobufs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # b":W&B", a 2-byte magic, a 1-byte version


def records(path: Path) -> list[bytes]:
    """The payloads of a ``.wandb`` log file (FULL, or FIRST/MIDDLE/LAST fragments joined)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out: list[bytes] = []
    pos, parts = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
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

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
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
