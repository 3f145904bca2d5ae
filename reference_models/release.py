"""The release checkpoint layout, by its old address: names re-exported from where they live now.

A released MammothModa2 directory (docs/checkpoints.md) holds one composite model: a nested
`config.json` (`model_type` "mammothmoda2") with one section per family, tensors prefixed by the
submodule that owns them. Where each part lives:

* the shared vocabulary (`ReleaseLayout`, `TensorRule`, `ParsedConfig`, `ReleaseConfigError`,
  `read_config_json`, ...): `reference_models/common/release_layout.py`;
* the AR family: its config reading (`parse_ar`, upstream's text-config defaults) in
  `reference_models/ar/config.py`, its tensor names, `load_ar` and what a release writes in
  `reference_models/ar/release.py`;
* the DiT family: `reference_models/dit/release.py` (`parse_dit`, its tensor rules);
* the registry of the families' layouts, keyed like `parity.target.FAMILIES`:
  `reference_models/families.py` (`LAYOUTS`);
* writing a release-layout directory (`write_release_checkpoint`, `make-checkpoint --layout
  release`): `reference_models/checkpoints.py`.

Nothing in `reference_models` imports this module (tests/repo/test_layering.py checks that no import,
at module level or inside a function, closes a cycle).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reference_models import families
from reference_models.ar import release as ar_release
from reference_models.ar.config import QWEN2_LLM, QWEN3_LLM, TEXT_DEFAULTS, TEXT_IGNORED_REASONS, parse_ar
from reference_models.ar.release import AR_RULES, ar_release_config, release_name
from reference_models.checkpoints import write_release_checkpoint
from reference_models.common.release_layout import (
    CONFIG_FILE,
    RELEASE_MODEL_TYPE,
    ParsedConfig,
    ReleaseConfigError,
    ReleaseLayout,
    TensorRule,
    describe_value,
    is_release_config,
    read_config_json,
)
from reference_models.dit.release import parse_dit
from reference_models.families import LAYOUTS

__all__ = [
    "AR_RULES",
    "CONFIG_FILE",
    "LAYOUTS",
    "QWEN2_LLM",
    "QWEN3_LLM",
    "RELEASE_MODEL_TYPE",
    "TEXT_DEFAULTS",
    "TEXT_IGNORED_REASONS",
    "ParsedConfig",
    "ReleaseConfigError",
    "ReleaseLayout",
    "TensorRule",
    "ar_release_config",
    "describe_value",
    "is_release_config",
    "load_ar",
    "parse_ar",
    "parse_dit",
    "read_config_json",
    "release_name",
    "write_release_checkpoint",
]


def load_ar(directory: str | Path, device: Any = "cpu", dtype: Any = None) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """`reference_models.ar.release.load_ar`, the other families' tensors left to them."""
    return ar_release.load_ar(directory, device, dtype, others=families.others("ar"))
