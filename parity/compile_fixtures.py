"""pytest fixtures around Dynamo state; the plugin (or a test module) imports them to use them.

`fresh_compile_state` is autouse: every test that can see it starts with an empty Dynamo cache,
so a test that asserts "compiled once on the first shape" cannot pass or fail because of what an
earlier test compiled (vllm-omni#7455's cache bleed).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from parity.compile_watch import CompileLedger, reset_compile_state


@pytest.fixture(autouse=True)
def fresh_compile_state() -> Iterator[None]:
    reset_compile_state()
    yield


@pytest.fixture
def compile_ledger() -> Iterator[CompileLedger]:
    """A ledger watching for the whole test."""
    with CompileLedger() as ledger:
        yield ledger
