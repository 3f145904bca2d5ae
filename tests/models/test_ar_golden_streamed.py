"""The streamed AR golden against the whole-model golden, at tiny size on the CPU.

The streamed golden (`parity.suites.ar.golden`) holds no weight between forwards and brings each
unit's weights (a table, a decoder layer, the final norm, a head) for that unit's forward only.
It is bit-identical to the whole model by construction: the module's own forward runs (the same
ops in the same order), and each unit gets the tensors the whole model's loader would give it
(the same checkpoint tensors cast by the same `.to(device, dtype)`, or the same per-name seeded
draws of `random_state_dict`). So these tests ask for `torch.equal`, not a tolerance; each has a
broken variant that the same comparison catches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.localise.observe import observe_eager, resolve
from parity.localise.vocabulary import vocabulary
from parity.suites.ar import golden as ar_golden
from parity.suites.ar.support import full_size_need
from parity.suites.device_memory import GIB, DeviceMemoryError, require_device_bytes
from parity.suites.streaming import StreamedWeights
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import ar_config
from reference_models.ar.model import MammothModa2ForCausalLM
from reference_models.checkpoints import SeededARWeights, make_checkpoint, random_state_dict
from tests.support.ar_support import SEED, TINY, mixed_ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("ar", "tiny", SEED, tmp_path_factory.mktemp("golden-stream"))


def assert_same_forward(whole: ReferenceARAdapter, streamed: ReferenceARAdapter, ids: torch.Tensor) -> None:
    want, got = whole.forward(ids), streamed.forward(ids)
    assert torch.equal(want.logits, got.logits)
    assert len(want.hidden_states) == len(got.hidden_states)
    for layer, (a, b) in enumerate(zip(want.hidden_states, got.hidden_states, strict=True)):
        assert torch.equal(a, b), f"layer {layer}"


def no_weight_resident(adapter: ReferenceARAdapter) -> bool:
    return all(p.is_meta for p in adapter.module.parameters())


def test_streamed_golden_of_a_checkpoint_equals_the_whole_golden_bit_for_bit(checkpoint: Path) -> None:
    """The suites' tiny golden: the checkpoint's fp32 tensors held on the host, each unit cast to
    fp64 for its forward, against `ReferenceARAdapter.load(checkpoint, "cpu", float64)`; a batch of
    text and gen ids (both experts, both tables, the heads) and the upstream decode loop."""
    whole = ReferenceARAdapter.load(checkpoint, "cpu", torch.float64)
    streamed = ar_golden.from_checkpoint(checkpoint, "cpu")
    ids = mixed_ids()
    assert_same_forward(whole, streamed, ids)
    want, got = whole.greedy_generate(ids[:, :5], 4), streamed.greedy_generate(ids[:, :5], 4)
    assert torch.equal(want.tokens, got.tokens) and torch.equal(want.step_logits, got.step_logits)
    assert no_weight_resident(streamed) and streamed.streamed.peak_units == 1


def test_streamed_golden_of_a_release_directory_equals_the_whole_golden(tmp_path: Path) -> None:
    """`--checkpoint-layout release`: the nested config and prefixed names are read as the whole
    model's `from_pretrained` reads them, so the units get the same tensors."""
    directory = make_checkpoint("ar", "tiny", SEED, tmp_path / "release", layout="release")
    whole = ReferenceARAdapter.load(directory, "cpu", torch.float64)
    assert_same_forward(whole, ar_golden.from_checkpoint(directory, "cpu"), mixed_ids())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64-golden", "bf16-reference"])
def test_streamed_draws_equal_the_whole_random_state_dict_bit_for_bit(dtype: torch.dtype) -> None:
    """The full-size path at tiny size: each unit drawn per forward from the per-name generators
    of `random_state_dict` equals the model built from the whole state dict (the golden in fp64;
    the same code streams a reference in the run's dtype)."""
    config = ar_config("tiny")
    whole = ReferenceARAdapter.build(config, random_state_dict(config, SEED, "cpu", dtype), "cpu", dtype)
    streamed = ar_golden.from_draws(config, SEED, "cpu", dtype)
    assert_same_forward(whole, streamed, mixed_ids())
    assert no_weight_resident(streamed)


def test_a_streamed_layer_draws_exactly_the_whole_state_dicts_tensors() -> None:
    """One decoder layer's names drawn alone are the whole state dict's tensors under those names."""
    config = ar_config("tiny")
    whole = random_state_dict(config, SEED, "cpu", torch.float64)
    names = [name for name in whole if name.startswith("model.layers.2.")]
    alone = SeededARWeights(config, SEED, "cpu", torch.float64)(names)
    assert list(alone) == names and all(torch.equal(alone[name], whole[name]) for name in names)
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        SeededARWeights(config, SEED, "cpu", torch.float64)(["model.layers.9.mlp.up_proj.weight"])


def test_the_comparison_catches_one_tensor_off_by_one_ulp(checkpoint: Path) -> None:
    """Broken variant: a source that gives one layer's down projection one ULP off in one element
    (what a wrong cast or another draw would do, at its smallest) fails the equality."""
    whole = ReferenceARAdapter.load(checkpoint, "cpu", torch.float64)
    streamed = ar_golden.from_checkpoint(checkpoint, "cpu")
    honest = streamed.streamed.source

    def nudged(names):
        tensors = dict(honest(names))
        name = "model.layers.1.mlp.down_proj.weight"
        if name in tensors:
            tensors[name] = tensors[name].clone()
            tensors[name][0, 0] = torch.nextafter(tensors[name][0, 0], torch.tensor(1.0, dtype=torch.float64))
        return tensors

    streamed.streamed.source = nudged
    with pytest.raises(AssertionError):
        assert_same_forward(whole, streamed, mixed_ids())


def test_stage_taps_see_the_same_values_on_the_streamed_golden(checkpoint: Path) -> None:
    """Localisation taps the golden's modules (docs/localise.md): every stage of the reference's
    map records the same value on the streamed golden as on the whole one."""
    whole = ReferenceARAdapter.load(checkpoint, "cpu", torch.float64)
    streamed = ar_golden.from_checkpoint(checkpoint, "cpu")
    ids = mixed_ids()
    layers, words = TINY.num_hidden_layers, vocabulary("ar")
    _, want = observe_eager(whole.module, resolve(whole.module, whole.stage_map, words, layers), lambda: whole.forward(ids))
    _, got = observe_eager(
        streamed.module, resolve(streamed.module, streamed.stage_map, words, layers), lambda: streamed.forward(ids)
    )
    recorded = {site: value for site, value in want.items() if value is not None}
    assert len(recorded) > 10 * layers  # q, k, v, rope, attention, both experts, norms per layer
    for site, value in recorded.items():
        assert got[site] is not None and torch.equal(value.value, got[site].value), site


def test_one_unit_at_a_time_and_none_after_the_forward(checkpoint: Path) -> None:
    """The memory promise: during a forward one unit's weights are in place, after it none; a
    stream whose release is switched off (broken variant) is caught by the same counters."""
    streamed = ar_golden.from_checkpoint(checkpoint, "cpu")
    streamed.forward(mixed_ids())
    assert streamed.streamed.peak_units == 1 and not streamed.streamed.brought and no_weight_resident(streamed)

    leaky = ar_golden.from_checkpoint(checkpoint, "cpu")
    leaky.streamed._release = lambda unit: None
    leaky.forward(mixed_ids())
    assert leaky.streamed.peak_units == len(leaky.streamed.units) and not no_weight_resident(leaky)


def test_a_forward_that_raises_leaves_no_weight_behind(checkpoint: Path) -> None:
    """An id outside both tables raises inside the forward (docs/model.md §5); the layer already
    brought is released all the same (`always_call`)."""
    streamed = ar_golden.from_checkpoint(checkpoint, "cpu")
    with pytest.raises(IndexError):
        streamed.forward(torch.tensor([[3, 10_000]]))
    assert not streamed.streamed.brought and no_weight_resident(streamed)


def test_units_must_cover_every_parameter_once() -> None:
    config = ar_config("tiny")
    with torch.device("meta"):
        module = MammothModa2ForCausalLM(config)
    source = SeededARWeights(config, SEED, "cpu", torch.float64)
    units = ar_golden.ar_units(config)
    with pytest.raises(ValueError, match=r"not in a unit \['lm_head.weight'\]"):
        StreamedWeights(module, [u for u in units if u != "lm_head"], source)
    with pytest.raises(ValueError, match=r"in two \['model.layers.0.mlp"):
        StreamedWeights(module, [*units, "model.layers.0.mlp"], source)


def test_a_source_of_the_wrong_shape_is_named(checkpoint: Path) -> None:
    streamed = ar_golden.from_checkpoint(checkpoint, "cpu")
    honest = streamed.streamed.source
    streamed.streamed.source = lambda names: {n: t[:-1] if n == "model.norm.weight" else t for n, t in honest(names).items()}
    with pytest.raises(ValueError, match=r"model.norm.weight: the source gave shape \(63,\), the module wants \(64,\)"):
        streamed.forward(mixed_ids())


def test_full_size_need_fits_an_h100_and_names_the_card_that_cannot_hold_it(monkeypatch) -> None:
    """The full-size AR family in bf16 with the streamed golden: the target and reference whole
    (2 x 19.9 GiB) and the largest streamed unit (an embedding table or head: 4.1 GiB in fp64 and
    its 2.0 GiB fp32 draw). An H100 (78.5 GiB free) holds it; a 40 GB card is refused with the parts,
    the need and the card in one line. The same need with a whole fp64 golden (79.7 GiB more) is
    what an H100 could not hold."""
    need = full_size_need(ar_config("full"), torch.bfloat16)
    assert list(need) == ["target bfloat16", "reference bfloat16", "streamed float64 golden (largest unit)"]
    assert round(need["target bfloat16"] / GIB, 1) == 19.9
    assert round(need["streamed float64 golden (largest unit)"] / GIB, 1) == 6.1
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(78.5 * GIB), int(79.2 * GIB)))
    require_device_bytes("full-size AR", need, torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(39.0 * GIB), int(39.4 * GIB)))
    with pytest.raises(DeviceMemoryError) as caught:
        require_device_bytes("full-size AR", need, torch.device("cuda:0"))
    assert str(caught.value).startswith(
        "full-size AR: target bfloat16 19.9 GiB + reference bfloat16 19.9 GiB + streamed float64 golden (largest unit) "
        "6.1 GiB = 46.0 GiB of weights needed on cuda:0, which has 39.0 GiB free of 39.4 GiB (NVIDIA A100-SXM4-40GB)"
    ), caught.value
