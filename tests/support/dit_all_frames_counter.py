"""A broken harness variant, loaded with `-p tests.support.dit_all_frames_counter` by tests/suites/test_suites_dit.py:
the DiT suites' compile counter counts every compiled frame instead of the block's `forward`
(the counter of vllm-project/vllm-omni#7455 before review). The recompile suite must turn red under it."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from parity.suites.dit import support as dit_support

    dit_support.count_block_compiles = lambda ledger, codes: ledger.compiles()
