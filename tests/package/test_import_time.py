"""`import lightning_recorder` costs a small fraction of `import torch`.

Measured with ``python -X importtime`` in one fresh interpreter, so both numbers come from the
same process under the same load: the package's own cumulative import time (torch already
loaded) must stay under a quarter of torch's. Before the lazy face it was more than twice
torch's (Lightning and torchmetrics were imported eagerly); with it, about a twentieth.
"""

from __future__ import annotations

import re
import subprocess
import sys

BOUND = 0.25  # the package's import time over torch's


def _cumulative_us(stderr: str, module: str) -> int:
    pattern = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)$")
    for line in stderr.splitlines():
        match = pattern.match(line)
        if match and match.group(3) == module and not match.group(2):  # a top-level import
            return int(match.group(1))
    raise AssertionError(f"no top-level import of {module} in -X importtime output")


def test_package_import_is_a_fraction_of_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import torch; import lightning_recorder"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    torch_us = _cumulative_us(result.stderr, "torch")
    package_us = _cumulative_us(result.stderr, "lightning_recorder")
    assert package_us < BOUND * torch_us, (package_us, torch_us)
