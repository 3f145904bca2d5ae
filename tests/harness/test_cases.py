"""Case files: typed records from good files, one clear line (file, table, key) from bad ones."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from parity.cases import CaseFileError, Table, load_case_file
from parity.compare import Tolerance


@dataclasses.dataclass(frozen=True)
class Prompt:
    name: str
    ids: list[list[int]]
    seed: int
    scale: float = 1.0
    mode: Literal["eager", "cpu_graph"] = "eager"
    shape: tuple[int, int] | None = None


SCHEMA = {
    "tolerances": Table(Tolerance, keyed=True),
    "prompts": Table(Prompt),
    "settings": Table(Prompt, many=False, required=False),
}

GOOD = """
[tolerances.fp32]
atol = 1e-5
rtol = 0
reason = "fp32 accumulation order"

[[prompts]]
name = "mixed"
ids = [[1, 2, 300]]
seed = 3
scale = 2
shape = [1, 3]

[[prompts]]
name = "gen-only"
ids = [[256]]
seed = 0
mode = "cpu_graph"
"""


def _write(tmp_path, text: str):
    path = tmp_path / "ar.toml"
    path.write_text(text)
    return path


def test_a_good_file_loads_typed_records(tmp_path) -> None:
    cases = load_case_file(_write(tmp_path, GOOD), SCHEMA)
    assert cases["tolerances"]["fp32"] == Tolerance(1e-5, 0.0, "fp32 accumulation order")
    mixed, gen = cases["prompts"]
    assert mixed.scale == 2.0 and isinstance(mixed.scale, float) and mixed.shape == (1, 3)
    assert gen.mode == "cpu_graph" and gen.scale == 1.0 and gen.shape is None
    assert cases["settings"] == {}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[[prompts]\nname = 1", "invalid TOML"),
        (
            GOOD + '\n[[prompts]]\nname = "x"\nids = [[1]]\nseed = 1\ncolour = "red"\n',
            "table [prompts] case 'x': key 'colour': expected one of the keys",
        ),
        (
            GOOD + '\n[[prompts]]\nname = "x"\nids = [[1]]\nseed = "one"\n',
            "table [prompts] case 'x': key 'seed': expected int, found str 'one'",
        ),
        (
            GOOD + '\n[[prompts]]\nname = "x"\nids = [[1]]\n',
            "table [prompts] case 'x': key 'seed': expected int, found nothing (missing field)",
        ),
        (GOOD + '\n[[prompts]]\nname = "x"\nids = [[1, "a"]]\nseed = 1\n', "key 'ids[0][1]': expected int, found str 'a'"),
        (
            GOOD + '\n[[prompts]]\nname = "x"\nids = [[1]]\nseed = 1\nmode = "turbo"\n',
            "key 'mode': expected 'eager' | 'cpu_graph', found str 'turbo'",
        ),
        (GOOD + '\n[[prompts]]\nname = "mixed"\nids = [[1]]\nseed = 1\n', "a unique case name, found a duplicate 'mixed'"),
        (GOOD + '\n[[prompts]]\nname = "x"\nids = [[1]]\nseed = true\n', "key 'seed': expected int, found bool True"),
        (GOOD + "\n[extra]\na = 1\n", "table [extra]: unknown table"),
        (
            GOOD.replace('reason = "fp32 accumulation order"', 'reason = " "'),
            "table [tolerances.fp32]: expected a valid Tolerance, found a tolerance needs a stated reason",
        ),
        ("[tolerances.fp32]\natol = 1\nrtol = 1\nreason = 'x'\n", "table [prompts]: missing"),
    ],
    ids=[
        "bad-toml",
        "unknown-key",
        "wrong-type",
        "missing-field",
        "nested-type",
        "literal",
        "duplicate",
        "bool-not-int",
        "unknown-table",
        "post-init",
        "missing-table",
    ],
)
def test_malformed_files_give_one_line_naming_file_table_and_key(tmp_path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(CaseFileError) as info:
        load_case_file(path, SCHEMA)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path.name)) or "ar.toml" in message.split(":")[0]
    assert expected in message


def test_missing_file_is_named(tmp_path) -> None:
    with pytest.raises(CaseFileError, match="nope.toml: case file not found"):
        load_case_file(tmp_path / "nope.toml", SCHEMA)
