"""ActivationWriter under DDP: two CPU processes, each sample written once, with its rank."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.scripts import run_script

from lightning_recorder.activations import ActivationDataset

HERE = Path(__file__).resolve().parent


def shard_header(path: Path) -> dict[str, Any]:
    """A shard's safetensors header ``{key: {"dtype", "shape", "data_offsets"}}``, read with the
    reference reader when installed, else from the documented layout (json and struct)."""
    try:
        from safetensors import safe_open
    except ImportError:  # the layout: u64 little-endian header size, then the JSON header
        data = path.read_bytes()
        size = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + size])
        header.pop("__metadata__", None)
        assert 8 + size + max([v["data_offsets"][1] for v in header.values()] + [0]) == len(data)
        return header
    with safe_open(str(path), framework="pt") as handle:
        return {k: {"shape": list(handle.get_slice(k).get_shape())} for k in handle.keys()}  # noqa: SIM118


def check_index_is_exact(directory: Path) -> None:
    for index in directory.glob("*.index.json"):
        entry = json.loads(index.read_text())
        header = shard_header(directory / entry["shard"])
        assert sorted(header) == sorted(c["key"] for c in entry["chunks"])
        for chunk in entry["chunks"]:
            assert header[chunk["key"]]["shape"] == chunk["shape"]


@pytest.mark.slow
def test_ddp_each_sample_once_with_provenance(tmp_path: Path) -> None:
    run_script(HERE.parent / "helpers" / "ddp_activations_script.py", tmp_path)
    from helpers.ddp_activations_script import N, Net, data

    acts = tmp_path / "acts"
    check_index_is_exact(acts)
    names = sorted(p.name for p in acts.glob("*.safetensors"))
    assert {n.split("-")[1] for n in names} == {"rank00000", "rank00001"}  # one set per rank
    dataset = ActivationDataset(acts, "body.2")
    assert sorted(dataset.sample_indices.tolist()) == list(range(N))  # each sample once
    model, x = Net(), data()
    for chunk in ActivationDataset(acts).chunks:
        rank, indices = chunk["rank"], chunk["sample_index"]
        assert all(i % 2 == rank for i in indices)  # Lightning's sampler: rank::2
        with torch.no_grad():
            hidden = model.body[1](model.body[0](x[indices]))
            expected = hidden if chunk["module"] == "body.1" else model.body[2](hidden)
        assert torch.equal(dataset._chunk_tensor(chunk), expected)
    assert len({c["run"] for c in ActivationDataset(acts).chunks}) == 1
