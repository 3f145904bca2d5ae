"""On a machine with several GPUs: each xdist worker of a `--device cuda` run sees exactly its own GPU.

Run as `pytest tests/runners/test_gpu_pinning_live.py --device cuda -n 2` on a 2-GPU machine (checked on
an nvidia-h200-x2 machine); without xdist or with one GPU there is nothing to pin and it skips.
"""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = pytest.mark.parity_gpu


@pytest.mark.parametrize("repeat", range(4))  # several tests, so every worker runs at least one
def test_each_worker_sees_only_its_own_gpu(repeat: int, pytestconfig) -> None:
    import torch

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    physical = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    if pytestconfig.getoption("--parity-device") != "cuda" or not worker or physical < 2:
        pytest.skip("needs --device cuda, pytest-xdist and at least two GPUs")
    expected = str(int(worker.removeprefix("gw")) % physical)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected
    assert torch.cuda.device_count() == 1
    uuid = torch.cuda.get_device_properties(0).uuid
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
    assert str(uuid) in listing[int(expected)], f"{worker} sees {uuid}, expected GPU {expected}: {listing}"
