"""Timings of the tiny DiT stage on the CPU lane (pytest-benchmark; run with `-p no:xdist`).

A full 4-step CFG sample at 32x32 latents (the `image` suite's loop), eager, per implementation.
Measured on the shared 2-core helper box with one thread: text length 4, ~0.06 s serving and
~0.09 s reference; text length 77, ~0.10 s and ~0.19 s. With two threads while other processes
load the cores: 0.3 s to 4 s (OpenMP oversubscription).
"""

from __future__ import annotations

import pytest

from tests.support.dit_support import tiny_pair


@pytest.mark.benchmark(group="dit-sample")
@pytest.mark.parametrize("impl", ["reference", "serving"])
def test_tiny_cfg_sample_eager(benchmark, impl):
    reference, serving = tiny_pair()
    adapter = reference if impl == "reference" else serving
    text, mask = adapter.text_condition(77, seed=0)
    latents = benchmark.pedantic(adapter.sample, args=(text, mask, 32, 32, 4, 4.0, (0.0, 1.0), 0), rounds=5, warmup_rounds=1)
    assert latents.shape == (1, 16, 32, 32)
