"""Positions as the release computes them, for every AR case parity runs: M-RoPE reduces to 1-D RoPE.

The release's Qwen2.5-VL text model takes 3-axis positions (temporal, height, width) and applies
RoPE with `rope_scaling.mrope_section`: frequency band `i` of the head dimension takes its angle from
axis `i % 3` of the sections (repeated for the two halves). `get_rope_index` gives vision rows
(image or video placeholders with a grid) distinct t/h/w positions; every other row gets
`arange(L)` on all three axes. Parity's cases hold no vision placeholder (their visual tokens are
generated gen-vocabulary ids, not image-understanding patches), so all three axes are equal and
the sectioned RoPE is exactly the 1-D RoPE both implementations compute (docs/checkpoints.md §3).
Bitwise by construction: the same cos/sin values are only re-sliced. The last test shows the check
sees a difference where the axes differ (a vision grid).
"""

from __future__ import annotations

import pytest
import torch

from parity.suites.ar.support import CASES, PROMPTS, token_tensor
from reference_models.ar.config import ar_config
from reference_models.ar.model import Qwen2RotaryEmbedding

pytestmark = pytest.mark.parity_cpu

# The release's vision placeholders and markers (Mammothmoda2Qwen2_5_VLConfig / Qwen3 defaults).
VISION_TOKEN_IDS = {151652, 151653, 151655, 151656}


def release_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """`get_rope_index` for rows without image/video grids (no attention mask): arange on 3 axes."""
    batch, length = input_ids.shape
    return torch.arange(length).view(1, 1, -1).expand(3, batch, length)


def mrope_cos_sin(
    rotary: Qwen2RotaryEmbedding, position_ids: torch.Tensor, sections: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of M-RoPE: per axis the 1-D tables, then band i of each half from axis i % 3."""
    per_axis = [rotary(position_ids[axis], torch.float32) for axis in range(3)]
    cos = torch.stack([c for c, _ in per_axis])
    sin = torch.stack([s for _, s in per_axis])
    split = sections * 2

    def select(table: torch.Tensor) -> torch.Tensor:
        return torch.cat([chunk[i % 3] for i, chunk in enumerate(table.split(split, dim=-1))], dim=-1)

    return select(cos), select(sin)


def all_case_rows(size: str) -> list[tuple[str, torch.Tensor]]:
    config = ar_config(size)
    cases = [(p.name, token_tensor(p.rows, config, size, torch.device("cpu"))) for p in PROMPTS]
    cases += [(d.name, token_tensor(d.prompt, config, size, torch.device("cpu"))) for d in CASES["decode"]]
    return cases


@pytest.mark.parametrize(("size", "sections"), [("tiny", [2, 3, 3]), ("full", [16, 24, 24])])
def test_every_case_has_equal_axes_and_mrope_equals_1d_rope(size: str, sections: list[int]) -> None:
    config = ar_config(size)
    assert sum(sections) == config.head_dim // 2
    rotary = Qwen2RotaryEmbedding(config.head_dim, config.rope_theta)
    for name, ids in all_case_rows(size):
        assert not set(ids.flatten().tolist()) & VISION_TOKEN_IDS, f"{name}: a vision placeholder would get a 3-D grid"
        positions = release_position_ids(ids)
        assert torch.equal(positions[0], positions[1]) and torch.equal(positions[1], positions[2])
        want_cos, want_sin = mrope_cos_sin(rotary, positions, sections)
        got_cos, got_sin = rotary(positions[0], torch.float32)  # what both implementations compute
        assert torch.equal(want_cos, got_cos) and torch.equal(want_sin, got_sin), name
        # Decode continues the same positions (the release's rope_deltas are 0 without vision rows).
        steps = torch.arange(ids.shape[1], ids.shape[1] + 8).expand(ids.shape[0], -1)
        step_cos, _ = mrope_cos_sin(rotary, steps.expand(3, -1, -1), sections)
        assert torch.equal(step_cos, rotary(steps, torch.float32)[0]), name


def test_the_check_sees_distinct_axes() -> None:
    """A 2x2 vision grid (t fixed, h/w varying) is not 1-D RoPE: the equality above can fail."""
    config = ar_config("tiny")
    rotary = Qwen2RotaryEmbedding(config.head_dim, config.rope_theta)
    positions = torch.tensor([[[0, 1, 1, 1, 1, 3]], [[0, 1, 1, 2, 2, 3]], [[0, 1, 2, 1, 2, 3]]])
    cos, _ = mrope_cos_sin(rotary, positions, [2, 3, 3])
    assert not torch.equal(cos, rotary(positions[0], torch.float32)[0])
