"""Routing suite, invariance: one capture replayed while the count changes (`replay-`) and a row
routed alone, inside a batch, anywhere in it (`batch-`). Both bit for bit (docs/routing.md R8).

replay-: the harness runner records the target's router once at capacity C on its all-zero
dummy inputs (`cpu_graph` on the CPU, `cuda_graph` on CUDA), then each step copies new logits and
the step's count into the same static buffers and replays; every replay must equal eager on the
same inputs. A router that reads the count on the host either cannot be recorded (an `error` row)
or replays the recorded count (a `fail` row).
"""

from __future__ import annotations

import pytest

from parity.runners import make_runner
from parity.suites.conftest import require_graph_support
from parity.suites.routing.cases import CASES
from parity.suites.routing.support import batch_rows, replay_rows, write_rows

pytestmark = pytest.mark.parity_suite("routing")

GRAPH_MODE = {"cpu": "cpu_graph", "cuda": "cuda_graph"}


@pytest.mark.parametrize("kind", CASES["replay"].kinds)
def test_replay_follows_the_device_count(kind: str, report, target, device, settings) -> None:
    mode = GRAPH_MODE[device.type]
    router = target.router()
    require_graph_support(router, mode)
    seed = CASES["replay"].seed + settings.seed
    runner = make_runner(mode, device=device, capture_registry=target.capture)
    write_rows(report, replay_rows(router, runner, kind, device, seed), mode=mode, seed=seed)


@pytest.mark.parametrize("renormalize", CASES["batch"].renormalize, ids=lambda r: "renorm" if r else "norenorm")
@pytest.mark.parametrize("kind", CASES["batch"].kinds)
def test_batch_invariance(kind: str, renormalize: bool, report, target, device, settings) -> None:
    seed = CASES["batch"].seed + settings.seed
    write_rows(report, batch_rows(target.router(), kind, renormalize, device, seed), seed=seed)
