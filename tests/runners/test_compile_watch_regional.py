"""Regional compile of `_repeated_blocks`, counted per code object (the defects of vllm-project/vllm-omni#7455)."""

from __future__ import annotations

import torch
from torch import nn

from parity.observe.compile_ledger import CompileLedger, fail_on_recompile
from parity.observe.regional import compile_repeated_blocks
from tests.support.runners_toys import WIDTH, seeded_linear


class LibraryActivation(nn.Module):
    """Library code that compiles its own frame, as vLLM's SiluAndMul.forward_native does."""

    def __init__(self) -> None:
        super().__init__()
        self._compiled = torch.compile(self.forward_native, backend="eager", dynamic=True)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._compiled(x)


class Block(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.proj = seeded_linear(seed)
        self.act = LibraryActivation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.proj(x))


class Tower(nn.Module):
    _repeated_blocks = ["Block"]

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(seed) for seed in range(depth))
        self.head = seeded_linear(99)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TowerWithoutBlocks(Tower):
    _repeated_blocks: list[str] = []


def test_compiles_every_declared_block_once_per_block_kind():
    model, twin = Tower(), Tower()
    x = torch.randn(5, WIDTH)
    with CompileLedger() as ledger:
        regional = compile_repeated_blocks(model, backend="eager", ledger=ledger)
        assert regional.count == 3
        assert regional.compiled == ("blocks.0", "blocks.1", "blocks.2")
        with torch.no_grad():
            got, expected = model(x), twin(x)
    # The eager backend runs the captured graph as is: bitwise equal to the eager twin.
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert ledger.compiles(Block.forward) == 1  # three instances, one block kind, one frame
    assert ledger.calls(Block.forward) == 3
    assert regional.rows()[0]["verdict"] == "pass"


def test_empty_repeated_blocks_compiles_zero_block_frames_and_says_so():
    """vllm-project/vllm-omni#7455: with `_repeated_blocks` empty the runner skipped compile, and a test that
    counted all frames still passed because the activation compiled on its own."""
    model = TowerWithoutBlocks()
    with CompileLedger() as ledger:
        regional = compile_repeated_blocks(model, backend="eager", ledger=ledger)
        with torch.no_grad():
            model(torch.randn(5, WIDTH))
    assert regional.count == 0
    assert ledger.compiles() >= 1  # the all-frames count that hid the defect
    assert ledger.compiles(Block.forward) == 0  # the count that shows it
    (row,) = regional.rows()
    assert row["value"] == 0 and row["verdict"] == "fail"
    assert "TowerWithoutBlocks._repeated_blocks is empty" in row["detail"]


def test_missing_repeated_blocks_is_reported():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block(0)

    regional = compile_repeated_blocks(Bare(), backend="eager")
    assert regional.count == 0 and regional.why_none == "Bare has no _repeated_blocks"


def test_declared_class_absent_is_reported():
    class Misnamed(Tower):
        _repeated_blocks = ["TransformerBlock"]

    regional = compile_repeated_blocks(Misnamed(), backend="eager")
    assert regional.count == 0 and "no submodule of Misnamed has a class named in ['TransformerBlock']" in regional.why_none


def test_restore_puts_the_eager_forward_back():
    model = Tower()
    regional = compile_repeated_blocks(model, backend="eager")
    assert all("forward" in block.__dict__ for block in model.blocks)
    regional.restore()
    with CompileLedger() as ledger, torch.no_grad():
        model(torch.randn(3, WIDTH))
    assert ledger.compiles(Block.forward) == 0


def test_no_block_recompile_across_a_size_lattice_after_warm_up():
    """The DiT suite's pattern: warm up the sizes that specialize (0 and 1 excluded here, the
    block is never called with them), then require zero recompiles."""
    model = Tower()
    with CompileLedger() as ledger:
        compile_repeated_blocks(model, backend="eager", ledger=ledger)
        with torch.no_grad():
            model(torch.randn(2, WIDTH))
            with fail_on_recompile():
                for rows in (3, 7, 16, 33):
                    model(torch.randn(rows, WIDTH))
    assert ledger.compiles(Block.forward) == 1
    assert ledger.recompiles(Block.forward) == []
