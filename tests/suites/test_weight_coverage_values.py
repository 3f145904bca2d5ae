"""weight_coverage judges the values the target's parameters hold, not only the names its map gives.

A loader that fills layer 2's gen `down_proj` from the und expert's tensor is caught both ways: with
an honest name map (the gen tensor is named by no parameter) the run goes on and weight_coverage
names the tensor no parameter received; with the intended name map (the map claims the gen
tensor) the pair that does not hold is named, where the name-only check passes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parity.observe import weight_values
from parity.observe.weight_values import _rows, holds, placement
from parity.report import read_results
from tests.support.helpers import PROJECT_ROOT, run_parity, run_pytest

pytestmark = pytest.mark.parity_cpu

GEN_DOWN = "model.layers.2.gen_mlp.down_proj.weight"
UND_DOWN = "model.layers.2.mlp.down_proj.weight"


def test_a_parameter_holds_a_tensor_in_the_forms_loaders_store_it() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 4, generator=g), torch.randn(2, 4, generator=g)
    fused = torch.cat([q, k])
    assert holds(fused, q) and holds(fused, k)  # row blocks of a fused projection
    assert holds(fused[torch.randperm(10, generator=g)], q)  # rows permuted (interleaved rotary)
    assert holds(torch.cat([q, q * 2], dim=1), q)  # a column block (a fused input dimension)
    assert holds(q.t().contiguous(), q)  # stored transposed
    bias = torch.randn(10, generator=g)
    assert holds(bias, bias[2:6].clone())  # a piece of a fused bias
    other = torch.randn(8, 4, generator=g)
    assert not holds(fused, other) and not holds(bias, torch.randn(4, generator=g))
    assert not holds(fused, q + 1e-6)  # a transformed tensor is not held


def test_a_rank_holds_its_shard_of_a_tensor_parallel_tensor() -> None:
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    column, row = weight.chunk(2, dim=0)[1], weight.chunk(2, dim=1)[0]  # column- and row-parallel shards
    for shard in (column, row):
        assert holds(shard, weight, shards=2) and not holds(shard, weight)  # a part is not the whole
    assert holds(bias.chunk(2)[0], bias, shards=2) and not holds(bias.chunk(2)[0], bias)
    assert not holds(weight.chunk(4, dim=0)[0], weight, shards=2)  # a quarter is not a rank's half


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.und, self.gen = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)


def test_a_tensor_in_the_wrong_parameter_fails_whatever_the_name_map_says() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {"und": torch.randn(4, 4, generator=g), "gen": torch.randn(4, 4, generator=g)}
    model = Pair()
    with torch.no_grad():
        model.und.weight.copy_(tensors["und"])
        model.gen.weight.copy_(tensors["und"])  # the loader's mix-up
    intended = placement(model, tensors.items(), lambda p: [p.split(".")[0]])
    assert intended.unreceived == ["gen"] and intended.misplaced == (("gen.weight", "gen"),)
    honest = placement(model, tensors.items(), lambda p: ["und"])
    assert honest.unreceived == ["gen"] and honest.misplaced == ()  # the map is right about what it did


class TwoFused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8, bias=False), nn.Linear(4, 8, bias=False)


def _host_copies_at_one_address(monkeypatch: pytest.MonkeyPatch, module: nn.Module) -> None:
    """`Tensor.cpu()` of a parameter as it is on a GPU: a fresh host copy, here always written to
    one scratch buffer per shape (the allocator handing the freed address to the next copy, the
    worst case, made certain)."""
    addresses = {param.data_ptr() for param in module.parameters()}
    scratch: dict[tuple[int, ...], torch.Tensor] = {}
    to_host = torch.Tensor.cpu

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.data_ptr() not in addresses:
            return to_host(self, *args, **kwargs)
        buffer = scratch.setdefault(tuple(self.shape), torch.empty(self.shape, dtype=self.dtype))
        return buffer.copy_(self)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)


def _rows_by_address(cache: dict, name: str, param: torch.Tensor) -> Callable[[bool], set[bytes]]:
    """The switched-off variant: rows cached by the host copy's address, as they once were."""

    def rows(transposed: bool) -> set[bytes]:
        host = param.detach().cpu()
        key = (str(host.data_ptr()), transposed)
        if key not in cache:
            cache[key] = _rows(host.t() if transposed else host)
        return cache[key]

    return rows


@pytest.mark.parametrize("cache", ["by-name", "by-address"])
def test_parameters_copied_to_the_host_one_at_a_time_are_each_judged_by_their_own_rows(
    cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the tiny engine example read 14 unreceived tensors, all rows of fused parameters: the
    row sets were cached by the host copy's address, and the copy of the next fused parameter of
    the same shape was made at the address of the one before. Keyed by name, each parameter is
    judged by its own rows; keyed by address (the switched-off variant), `b`'s tensors are lost."""
    g = torch.Generator().manual_seed(3)
    tensors = {name: torch.randn(4, 4, generator=g) for name in ("a.q", "a.k", "b.q", "b.k")}
    model = TwoFused()
    with torch.no_grad():
        model.a.weight.copy_(torch.cat([tensors["a.q"], tensors["a.k"]]))
        model.b.weight.copy_(torch.cat([tensors["b.q"], tensors["b.k"]]))
    _host_copies_at_one_address(monkeypatch, model)
    if cache == "by-address":
        monkeypatch.setattr(weight_values, "rows_by_name", _rows_by_address)
    result = placement(model, tensors.items(), lambda p: [])
    expected = {"a.q": ("a.weight",), "a.k": ("a.weight",), "b.q": ("b.weight",), "b.k": ("b.weight",)}
    assert (result.held_by == expected) == (cache == "by-name"), result.held_by


def _coverage_rows(tmp_path: Path, target: str) -> tuple[int, str, object]:
    args = ["parity/suites/ar/test_weight_coverage.py", "-q", "--parity-target", target]
    result = run_pytest([*args, "--parity-report-dir", str(tmp_path), "--parity-run-id", "r"], cwd=PROJECT_ROOT)
    return result.returncode, result.stdout + result.stderr, read_results(tmp_path / "r")


def test_an_honest_map_of_a_loader_defect_is_a_failure_row_and_the_run_goes_on(tmp_path: Path) -> None:
    """`parity run` used to stop at the conformance check (the map does not name the gen tensor),
    with no rows and no page; the tensor no parameter received is now a row that names it."""
    target = "tests.support.stage_defects:engine_gen_down_from_und_honest_map"
    result = run_parity(
        ["run", "--target", target, "--suite", "weight_coverage", "--report-dir", str(tmp_path), "--run-id", "r"],
        cwd=PROJECT_ROOT,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "does not conform" not in output, output[-3000:]
    frame = read_results(tmp_path / "r")
    rows = frame[(frame["case"] == "target-engine-example") & (frame["kind"] == "gate")].set_index("metric")
    assert rows.loc["unreceived_tensors", "verdict"] == "fail" and GEN_DOWN in rows.loc["unreceived_tensors", "detail"]
    assert rows.loc["misplaced_tensors", "verdict"] == "pass"  # the map says what the loader did
    assert (tmp_path / "r" / "index.html").is_file()
    reference = frame[(frame["case"].str.startswith("reference-")) & (frame["kind"] == "gate")]
    assert set(reference["verdict"]) == {"pass"}


def test_a_tensor_loaded_into_the_wrong_parameter_fails_with_the_intended_map(tmp_path: Path) -> None:
    code, output, frame = _coverage_rows(tmp_path, "tests.support.stage_defects:engine_gen_down_from_und")
    assert code == 1, output[-3000:]
    rows = frame[(frame["case"] == "target-engine-example") & (frame["kind"] == "gate")].set_index("metric")
    detail = rows.loc["misplaced_tensors", "detail"]
    assert rows.loc["misplaced_tensors", "verdict"] == "fail", detail
    assert f"layers.2.gen_mlp.down_proj.weight does not hold {GEN_DOWN} (it holds {UND_DOWN})" in detail
    # The switched-off variant, the check by names alone, passes this loader: every named tensor is read.
    assert rows.loc["unused_tensors", "verdict"] == "pass"
