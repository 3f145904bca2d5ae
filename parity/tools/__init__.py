"""Model tools: the commands that write and inspect checkpoints (`parity make-checkpoint`,
`parity inspect-checkpoint`).

The one layer of the harness that imports the reference models, and it does so with plain
imports, not import strings: the release layouts and the random-checkpoint writers live beside
the reference models (`reference_models/families.py`, `reference_models/checkpoints.py`). Only
the command line imports this layer, and only when one of its commands runs; the harness core
(`parity` outside `parity.suites` and `parity.tools`) imports no model (`tests/repo/test_layering.py`).
"""
