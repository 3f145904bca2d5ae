"""Each check of this area turns red on a broken runner or ledger.

The broken variants are applied with monkeypatch and the real tests are called as they are: a
runner that silently runs eager, a capture that does not tell the target, a stand-in without its
host-read guard, a ledger that counts every frame, no fallback detection, no Dynamo reset, a
regional compiler that compiles nothing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import parity.runners.cpu_graph
from parity.observe.compile_ledger import CompileLedger, reset_compile_state
from parity.observe.regional import RegionalCompile
from parity.runners.base import RunResult
from parity.runners.cpu_graph import CpuGraphRun
from tests.runners import test_compile_watch_ledger as ledger_tests
from tests.runners import test_compile_watch_regional as regional_tests
from tests.runners import test_runners_cpu_graph as cpu_graph_tests


def _runs_eager(self, *inputs):
    self._prepare_host(inputs)
    self.tapset.clear()
    with torch.no_grad():
        output = self.fn(*inputs)
    return RunResult(output=output, taps=self.tapset.snapshot())


@pytest.mark.parametrize(
    "check",
    [
        cpu_graph_tests.test_python_branch_is_baked_at_capture,
        cpu_graph_tests.test_host_branch_dispatch_bakes_the_dummy_batch_expert_7318,
        cpu_graph_tests.test_probe_reports_capturing_only_while_recording,
        cpu_graph_tests.test_replay_without_copy_in_is_stale,
    ],
    ids=lambda check: check.__name__,
)
def test_a_cpu_graph_that_silently_runs_eager_is_caught(monkeypatch, check):
    monkeypatch.setattr(CpuGraphRun, "__call__", _runs_eager)
    with pytest.raises(AssertionError):
        check()


def test_a_capture_that_does_not_tell_the_target_is_caught(monkeypatch):
    monkeypatch.setattr(parity.runners.cpu_graph, "reporting_capture", lambda registry, backend: contextlib.nullcontext())
    with pytest.raises(AssertionError):
        cpu_graph_tests.test_probe_reports_capturing_only_while_recording()


def test_a_stand_in_without_its_host_read_guard_is_caught(monkeypatch):
    monkeypatch.setattr(parity.runners.cpu_graph, "_no_host_copies", lambda site: contextlib.nullcontext())

    def let_through(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    monkeypatch.setattr(parity.runners.cpu_graph._HostSyncGuard, "__torch_dispatch__", let_through)
    for pattern in ("tolist", "numpy", "nonzero", "bool_mask"):
        with pytest.raises(pytest.fail.Exception):
            cpu_graph_tests.test_host_read_while_capturing_raises_naming_the_module(pattern)


def test_a_ledger_counting_every_frame_is_caught(monkeypatch):
    monkeypatch.setattr(CompileLedger, "_events_of", lambda self, target: list(self.events))
    with pytest.raises(AssertionError):
        ledger_tests.test_counts_only_the_asked_code_object()
    reset_compile_state()
    with pytest.raises(AssertionError):
        regional_tests.test_empty_repeated_blocks_compiles_zero_block_frames_and_says_so()


def test_a_ledger_blind_to_the_eager_fallback_is_caught(monkeypatch):
    monkeypatch.setattr(CompileLedger, "eager_fallbacks", lambda self: [])
    monkeypatch.setattr(CompileLedger, "limit_hits", lambda self, target=None: [])
    with pytest.raises((AssertionError, ValueError)):
        ledger_tests.test_silent_eager_fallback_past_the_recompile_limit_is_a_failure()


def test_a_reset_that_keeps_the_cache_is_caught(monkeypatch):
    monkeypatch.setattr(ledger_tests, "reset_compile_state", lambda: None)
    with pytest.raises(AssertionError):
        ledger_tests.test_cache_bleed_hides_a_compile_unless_state_is_reset()


def test_a_regional_compiler_that_compiles_nothing_is_caught(monkeypatch):
    monkeypatch.setattr(
        regional_tests, "compile_repeated_blocks", lambda model, **kwargs: RegionalCompile(declared=(), compiled=())
    )
    with pytest.raises(AssertionError):
        regional_tests.test_compiles_every_declared_block_once_per_block_kind()
