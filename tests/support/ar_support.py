"""Shared helpers of the AR tests (imported by tests/test_ar_*.py; not collected itself)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import ar_config, token_layout
from reference_models.checkpoints import make_checkpoint
from serving_models.ar.adapter import ServingARAdapter

TINY = ar_config("tiny")
LAYOUT = token_layout("tiny")
START = TINY.gen_vocab_start_index  # 256
GEN_LAST = START + TINY.gen_vocab_size - 1  # 319
SEED = 1234


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("ar", "tiny", SEED, tmp_path_factory.mktemp("ar_tiny"))


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> ReferenceARAdapter:
    return ReferenceARAdapter.load(tiny_dir)


@pytest.fixture(scope="module")
def serving(tiny_dir: Path) -> ServingARAdapter:
    return ServingARAdapter.load(tiny_dir)


def mixed_ids(batch: int = 3, length: int = 12, seed: int = 0) -> torch.Tensor:
    """Text and gen ids mixed, with the vocabulary boundaries in row 0 and an all-gen row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, GEN_LAST + 1, (batch, length), generator=g)
    ids[0, :5] = torch.tensor([START - 1, START, GEN_LAST, LAYOUT.eol, LAYOUT.image_end])
    ids[1] = torch.randint(START, GEN_LAST + 1, (length,), generator=g)
    return ids
