"""weight_coverage: every checkpoint tensor is read by a forward over the case set, in both models.

The defect: the MammothModa2 checkpoint ships 42 `gen_mlp.*` tensors (3 per layer, layers 14-27)
that a port loaded and never used, because the multimodal path dropped the ids and the gen expert
never ran (vllm-project/vllm-omni#9764). Loading checks cannot see that. This suite loads a tiny checkpoint,
runs every prompt (and a few decode steps) under a dispatch mode that records each parameter an op
reads, maps parameters back to checkpoint names (fused serving weights count for every tensor they
hold) and lists what was never read. It always uses the tiny checkpoint: coverage is structural.

The name map is the loader's account of itself, so the values are checked too
(`parity.observe.weight_values`): every checkpoint tensor must be held by some parameter (a tensor
no parameter received is a loader defect, named in an `unreceived_tensors` row, and the run goes
on), and every (parameter, tensor) pair of the name map must hold (`misplaced_tensors`: a tensor
loaded into the wrong parameter fails whatever the map says).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from parity.compare import AT_MOST, count_rule
from parity.observe.weight_reads import checkpoint_files, coverage, group_by_prefix, list_tensors
from parity.observe.weight_values import describe, placement
from parity.suites.ar.support import PROMPTS, token_tensor
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.checkpoints import make_checkpoint

pytestmark = pytest.mark.parity_suite("weight_coverage")


@pytest.fixture(scope="module")
def tiny_checkpoint(settings, tmp_path_factory):
    directory = tmp_path_factory.mktemp("coverage-checkpoint")
    return make_checkpoint("ar", "tiny", settings.seed, directory, layout=settings.checkpoint_layout)


def _calls(adapter, device: torch.device):
    """The case set: every prompt's forward, the multimodal entry, a prefill and decode steps."""
    from reference_models.ar.config import ar_config

    config = ar_config("tiny")
    calls = []
    for prompt in PROMPTS:
        ids = token_tensor(prompt.rows, config, "tiny", device)
        calls.append(lambda ids=ids: adapter.forward(ids))
        calls.append(lambda ids=ids: adapter.forward_multimodal(adapter.embed(ids), ids))
    prompt = token_tensor(PROMPTS[2].rows, config, "tiny", device)
    calls.append(lambda: adapter.greedy_generate(prompt, 4))
    return calls


@pytest.mark.parametrize("implementation", ["target", "reference"])
def test_every_checkpoint_tensor_is_read(implementation: str, tiny_checkpoint, target, device, report, settings) -> None:
    if implementation == "target":
        adapter = target.load_ar(tiny_checkpoint, device, torch.float32)
    else:
        adapter = ReferenceARAdapter.load(tiny_checkpoint, device, torch.float32)
    names = sorted(list_tensors(tiny_checkpoint))
    name_map = adapter.weight_name_map()
    result = coverage(adapter.module, names, _calls(adapter, device), lambda p: name_map.get(p, [p]))
    unused = result.unused
    groups = ", ".join(f"{prefix} ({count})" for prefix, count in group_by_prefix(unused).items())
    detail = f"{len(unused)} of {len(names)} checkpoint tensors never read" + (
        f": {groups}; first: {unused[:6]}" if unused else ""
    )
    case = f"{implementation}-{adapter.name}"
    report.verdict(count_rule(len(unused), 0, metric="unused_tensors", at=AT_MOST, detail=detail), case=case)
    report.info(
        case=case,
        metric="fraction_read",
        value=result.fraction,
        detail=f"{len(result.read)} of {len(names)} tensors read over {len(_calls(adapter, device))} calls",
    )
    tensors = {name: tensor for path in checkpoint_files(tiny_checkpoint) for name, tensor in load_file(path).items()}
    placed = placement(adapter.module, tensors.items(), lambda p: name_map.get(p, []), shards=settings.tp)
    unreceived, misplaced = describe(placed)
    report.verdict(count_rule(len(placed.unreceived), 0, metric="unreceived_tensors", at=AT_MOST, detail=unreceived), case=case)
    report.verdict(count_rule(len(placed.misplaced), 0, metric="misplaced_tensors", at=AT_MOST, detail=misplaced), case=case)
    if result.unattributed:
        report.info(
            case=case,
            metric="unattributed_parameters",
            value=len(result.unattributed),
            detail=f"read parameters the name map does not place in the checkpoint: {list(result.unattributed)[:6]}",
        )
