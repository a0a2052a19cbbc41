from __future__ import annotations

import torch

from lightning_recorder._core.compat import autocast_enabled


def test_autocast_is_seen_on_every_device_type_autocast_supports() -> None:
    """Mixed precision on MPS or XPU (Lightning's ``16-mixed`` there) is autocast of that device
    type: the statistics engine turns it off around its kernels and distillation connectors stay
    in the default dtype, as on CPU and CUDA. No such device is needed: the state is per type."""
    mps, cpu = torch.device("mps"), torch.device("cpu")
    assert not autocast_enabled(mps)
    with torch.autocast("mps", dtype=torch.float16):
        assert autocast_enabled(mps)  # read as off when only CPU and CUDA were asked
        assert not autocast_enabled(cpu)
    with torch.autocast("xpu", dtype=torch.bfloat16):
        assert autocast_enabled(torch.device("xpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_enabled(cpu)
    assert not autocast_enabled(torch.device("meta"))  # no autocast there: False, not an error
