"""The release checkpoint layout's shared vocabulary: the record each model family fills in.

A released MammothModa2 directory (docs/checkpoints.md) holds one composite model whose
`config.json` (`model_type` "mammothmoda2") carries one section per family and whose tensors are
prefixed by the submodule that owns them. Each family describes its part in a `ReleaseLayout`
(its own package: `reference_models/ar/release.py`, `reference_models/dit/release.py`): which
config keys it reads and how, which tensor prefixes are its and what they map to. The registry
of those records, keyed like `parity.target.FAMILIES`, is `reference_models/families.py`. Keys no
family reads are kept and listed as ignored; only contradictions are refused (`ReleaseConfigError`).

This module imports no family: every family imports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from reference_models.common import hf_checkpoint

RELEASE_MODEL_TYPE = "mammothmoda2"
CONFIG_FILE = "config.json"


class ReleaseConfigError(ValueError):
    """A release config.json whose values contradict each other or what the models can run."""


@dataclasses.dataclass
class ParsedConfig:
    """One family's reading of a config.json: the config object, where each field came from, and
    the keys of its sections it does not use (path -> value)."""

    config: Any
    recognised: dict[str, tuple[Any, str]]  # field -> (value, source: a key path or "default ...")
    ignored: dict[str, Any]
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # ignored path -> why that is safe


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """A release tensor prefix: the family's own name prefix it maps to, or None when the family
    knows the tensors but does not use them (`reason` says why)."""

    release: str
    local: str | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class ReleaseLayout:
    """A model family's part of the release layout. `key` is the family's key in
    `parity.target.FAMILIES` (which names it, and the target member that loads it)."""

    key: str
    config_keys: tuple[str, ...]  # top-level keys of the release config.json this family reads
    parse: Callable[[Mapping[str, Any], str], ParsedConfig]
    rules: tuple[TensorRule, ...]

    def local_name(self, name: str) -> tuple[str | None, str] | None:
        """(local name or None, reason) for a release tensor of this family; None if not its."""
        for rule in self.rules:
            if name.startswith(rule.release):
                local = None if rule.local is None else rule.local + name[len(rule.release) :]
                return local, rule.reason
        return None


def is_release_config(data: Mapping[str, Any]) -> bool:
    return data.get("model_type") == RELEASE_MODEL_TYPE or "llm_config" in data


def read_config_json(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
    return hf_checkpoint.read_json_object(path)  # not UTF-8, not JSON, not an object: one line naming the file


def describe_value(value: Any, limit: int = 60) -> str:
    """A config value as one short line (long objects elided)."""
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    if isinstance(value, float) and math.isfinite(value):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
