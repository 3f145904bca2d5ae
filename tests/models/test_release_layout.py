"""The release checkpoint layout (reference_models/common/release_layout.py, docs/checkpoints.md): written by
`make-checkpoint --layout release`, read by both implementations and the example engine, inspected by
`parity inspect-checkpoint`; the config read as upstream reads it; contradictions refused. The
commands and the suite session run in this process (`parity.cli.main`, `tests.support.helpers.run_isolated_session`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from parity.cli import main as parity_cli
from reference_models.ar.adapter import ReferenceARAdapter
from reference_models.ar.config import parse_ar
from reference_models.checkpoints import make_checkpoint, random_state_dict, write_release_checkpoint
from reference_models.common.release_layout import ReleaseConfigError
from serving_models.ar.config import MammothModa2ARConfig as ServingConfig
from tests.support.helpers import run_isolated_session

pytestmark = pytest.mark.parity_cpu

IDS = torch.tensor([[3, 17, 260, 42, 270, 99, 319, 5]])


def run_parity(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`parity <args>` in this process (`parity.cli.main`, what `python -m parity` exits with): exit
    code, stdout and stderr. A fresh interpreter per command would spend most of it importing torch
    and the harness again."""
    capsys.readouterr()
    code = parity_cli(args)
    printed = capsys.readouterr()
    return code, printed.out, printed.err


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded release-layout directory whose index does not carry the usual name."""
    directory = write_release_checkpoint(("ar",), "tiny", 0, tmp_path_factory.mktemp("release"), max_shard_bytes=40_000)
    (directory / "model.safetensors.index.json").rename(directory / "mammoth.safetensors.index.json")
    return directory


def test_the_release_directory_is_nested_and_prefixed(release_dir: Path) -> None:
    config = json.loads((release_dir / "config.json").read_text())
    assert config["model_type"] == "mammothmoda2" and "vision_config" in config["llm_config"]
    assert config["llm_config"]["text_config"]["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    index = json.loads((release_dir / "mammoth.safetensors.index.json").read_text())["weight_map"]
    assert "llm_model.model.language_model.layers.2.gen_mlp.up_proj.weight" in index and "llm_model.gen_head.weight" in index
    assert len(set(index.values())) > 1  # sharded


def test_round_trip_both_implementations_load_the_release_directory(release_dir: Path, tmp_path: Path) -> None:
    from examples.engine_target.parity_target import make_target as engine_target
    from serving_models.target import make_target as serving_target

    parity_dir = make_checkpoint("ar", "tiny", 0, tmp_path / "parity")
    reference = ReferenceARAdapter.load(release_dir, "cpu", torch.float32)
    # Same weights under other names: the reference's logits are bit-identical to the parity layout's.
    assert torch.equal(
        reference.forward(IDS).logits, ReferenceARAdapter.load(parity_dir, "cpu", torch.float32).forward(IDS).logits
    )
    for target in (serving_target(), engine_target()):
        adapter = target.load_ar(release_dir, "cpu", torch.float32)
        torch.testing.assert_close(adapter.forward(IDS).logits, reference.forward(IDS).logits, atol=1e-5, rtol=1.3e-6)
        names = {n for names in adapter.weight_name_map().values() for n in names}
        assert all(n.startswith("llm_model.") for n in names) and len(names) == 59
    assert all(v[0].startswith("llm_model.") for v in reference.weight_name_map().values())


def test_inspect_checkpoint_lists_config_and_mapping_and_exits_0(release_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_parity(["inspect-checkpoint", str(release_dir)], capsys)
    assert code == 0, out + err
    assert "release layout; 59 tensors in mammoth.safetensors.index.json" in out
    assert "rms_norm_eps          = 1e-06" in out and "from llm_config.text_config.rms_norm_eps" in out
    assert "llm_config.text_config.rope_scaling = " in out and "reduce to 1-D RoPE" in out
    assert "    reference: matched 59, unused 0, missing 0" in out
    assert "    target serving: matched 59, unused 0, missing 0" in out


def test_tensors_the_ar_does_not_use_are_listed_and_a_missing_one_fails(
    release_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = copy_dir(release_dir, tmp_path / "extra")
    save_file({"llm_model.model.visual.blocks.0.mlp.weight": torch.zeros(2, 2)}, str(extra / "other.safetensors"))
    add_to_index(extra, "other.safetensors", ["llm_model.model.visual.blocks.0.mlp.weight"])
    code, out, err = run_parity(["inspect-checkpoint", str(extra)], capsys)
    assert code == 0, out + err
    assert "not used (vision tower: image understanding is out of parity's scope): llm_model.model.* (1)" in out

    # a tensor no family knows is listed and never read: both loaders load the rest (docs/checkpoints.md §2)
    unknown = copy_dir(release_dir, tmp_path / "unknown")
    save_file({"other_model.x_embedder.weight": torch.zeros(2)}, str(unknown / "other.safetensors"))
    add_to_index(unknown, "other.safetensors", ["other_model.x_embedder.weight"])
    code, out, _ = run_parity(["inspect-checkpoint", str(unknown)], capsys)
    assert code == 0, out
    assert "tensors no family claims (1): other_model.x_embedder.* (1)" in out
    assert "unexpected" not in out and "other_model.x_embedder.weight" not in out.replace("other_model.x_embedder.*", "")

    broken = copy_dir(release_dir, tmp_path / "broken")
    index_path = broken / "mammoth.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["llm_model.model.language_model.layers.3.gen_mlp.down_proj.weight"]
    index_path.write_text(json.dumps(index))
    code, out, _ = run_parity(["inspect-checkpoint", str(broken)], capsys)
    assert code == 1
    lines = [ln for ln in out.splitlines() if "cannot load" in ln]
    assert len(lines) == 2 and all("model.layers.3.gen_mlp.down_proj.weight" in ln for ln in lines), out


def copy_dir(source: Path, target: Path) -> Path:
    import shutil

    return Path(shutil.copytree(source, target))


def add_to_index(directory: Path, filename: str, names: list[str]) -> None:
    path = directory / "mammoth.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"].update(dict.fromkeys(names, filename))
    path.write_text(json.dumps(index))


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_the_ar_suites_run_on_a_release_layout_directory(tmp_path: Path) -> None:
    """`--parity-checkpoint-layout release`: the suites' tiny checkpoints in the release layout."""
    selection = ["parity/suites/ar/test_numerics.py", "parity/suites/ar/test_weight_coverage.py"]
    selection += ["parity/suites/ar/test_expert_selection.py", "-k", "eager or coverage"]
    args = [*selection, "-m", "cpu", "-q", "--parity-checkpoint-layout", "release"]
    code, output = run_isolated_session(
        [*args, "--parity-report-dir", str(tmp_path), "--parity-run-id", "r"], tmp_path / "basetemp"
    )
    assert code == 0, output[-3000:]
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["checkpoint_layout"] == "release"
    from parity.report import read_results

    rows = read_results(tmp_path / "r")
    coverage = rows[(rows["suite"] == "weight_coverage") & (rows["metric"] == "unused_tensors")]
    assert len(coverage) == 2 and (coverage["verdict"] == "pass").all()


# ---------------------------------------------------------------------------------------------
# The config as upstream reads it
# ---------------------------------------------------------------------------------------------


def release_config(text: dict | None = None, **llm) -> dict:
    base = {
        "model_type": "mammothmoda2_qwen2_5_vl",
        "text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
    }
    if text is not None:
        base["text_config"] = text
    base.update(llm)
    return {"model_type": "mammothmoda2", "llm_config": base, "gen_dit_config": {"hidden_size": 8}}


def test_absent_keys_take_upstreams_defaults() -> None:
    parsed = parse_ar(release_config())
    config = parsed.config
    assert (config.rms_norm_eps, config.moe_type, config.vocab_size) == (1e-5, "ffn", 152064)
    assert config.gen_vocab_start_index == 152064 and parsed.recognised["gen_vocab_start_index"][1].startswith("derived")
    assert parsed.recognised["rms_norm_eps"] == (1e-5, "default (mammothmoda2_qwen2_5_vl)")
    # Both implementations read the same defaults (the serving port reads config.json itself).
    served = ServingConfig.from_release(release_config())
    assert (served.rms_norm_eps, served.moe_type, served.gen_vocab_start_index) == (1e-5, "ffn", 152064)


def test_llm_level_gen_keys_are_used_when_the_text_config_lacks_them() -> None:
    parsed = parse_ar(release_config(moe_type="ffn-14:28", gen_vocab_size=100))
    assert parsed.config.moe_type == "ffn-14:28" and parsed.recognised["moe_type"][1] == "llm_config.moe_type"
    assert ServingConfig.from_release(release_config(moe_type="ffn-14:28")).moe_type == "ffn-14:28"


def test_the_dev_backbone_defaults_put_the_gen_start_past_the_table() -> None:
    dev = release_config(model_type="mammothmoda2_qwen3_vl")
    parsed = parse_ar(dev)
    assert (parsed.config.vocab_size, parsed.config.gen_vocab_start_index, parsed.config.rms_norm_eps) == (151936, 152064, 1e-6)
    served = ServingConfig.from_release(dev)
    assert (served.vocab_size, served.gen_vocab_start_index) == (151936, 152064)


def test_unknown_keys_are_kept_and_listed() -> None:
    text = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "brand_new_knob": 3,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    }
    parsed = parse_ar(release_config(text))
    assert parsed.ignored["llm_config.text_config.brand_new_knob"] == 3
    assert parsed.reasons["llm_config.text_config.brand_new_knob"] == "not read by the AR models"
    assert "llm_config.text_config.rope_scaling" in parsed.ignored


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"llm": {"gen_vocab_size": 10}, "text": {"gen_vocab_size": 20}}, "llm_config.gen_vocab_size = 10 contradicts"),
        ({"text": {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}}}, "must be a list summing to head_dim / 2 = 8"),
        ({"text": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}}, "only default / mrope RoPE"),
        ({"text": {"use_sliding_window": True}}, "sliding-window attention is not implemented"),
        ({"text": {"head_dim": 32}}, "head_dim 32 is not hidden_size / num_attention_heads = 16"),
        ({"llm": {"model_type": "mammothmoda2_llama"}}, "llm_config.model_type 'mammothmoda2_llama'"),
    ],
)
def test_contradictions_are_refused(change: dict, message: str) -> None:
    data = release_config()
    data["llm_config"]["text_config"].update(change.get("text", {}))
    data["llm_config"].update(change.get("llm", {}))
    with pytest.raises(ReleaseConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_ar(copy.deepcopy(data))


# ---------------------------------------------------------------------------------------------
# The Dev vocabulary layout: the gen start is not the text table's size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("vocab_size", "start"), [(240, 256), (272, 256)], ids=["gap-like-dev", "table-past-start"])
def test_gen_start_other_than_the_table_size(vocab_size: int, start: int) -> None:
    from reference_models.ar.config import ar_config
    from serving_models.target import make_target

    config = ar_config("tiny").replace(vocab_size=vocab_size, gen_vocab_start_index=start)
    state = random_state_dict(config, 0, "cpu", torch.float32)
    reference = ReferenceARAdapter.build(config, state, "cpu", torch.float32)
    serving = make_target().build_ar(config, state, "cpu", torch.float32)
    ids = torch.tensor([[3, 17, start, 42, start + 20, 99, start + 63, 5]])
    torch.testing.assert_close(serving.forward(ids).logits, reference.forward(ids).logits, atol=1e-5, rtol=1.3e-6)
    assert serving.forward(ids).logits.shape[-1] == vocab_size + 64
    # Column vocab_size + j is token start + j, on both sides and in greedy decoding.
    columns = torch.tensor([vocab_size - 1, vocab_size, vocab_size + 63])
    assert config.token_of_column(columns).tolist() == [vocab_size - 1, start, start + 63]
    want, got = reference.greedy_generate(ids, 12), serving.greedy_generate(ids, 12)
    assert torch.equal(want.tokens, got.tokens)
    assert bool((want.tokens >= start).any()), "the prompt must decode into gen tokens for the mapping to matter"
    valid = (want.tokens < min(vocab_size, start)) | ((want.tokens >= start) & (want.tokens < start + 64))
    assert bool(valid.all()), want.tokens


def test_a_release_dit_directory_is_inspected_and_loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make-checkpoint dit --layout release` (the DiT under gen_transformer., the release's unused
    DiT tensors included): inspect-checkpoint reads its config keys, lists every unused tensor with
    its reason, and both implementations load it."""
    directory = tmp_path / "dit-release"
    assert run_parity(["make-checkpoint", "dit", str(directory), "--layout", "release"], capsys)[0] == 0
    code, out, err = run_parity(["inspect-checkpoint", str(directory)], capsys)
    assert code == 0, out + err
    assert "ar: not in this checkpoint (config keys llm_config, no tensors)" in out
    assert "text_feat_dim           = 64" in out and "from llm_config text width" in out
    assert "_class_name = " in out and "gen_dit_config._class_name" in out
    assert "not used (reference-image (editing) refiner" in out and "gen_transformer.ref_image_refiner.* (15)" in out
    assert "reference: matched 81, unused 0, missing 0" in out and "target serving: matched 81, unused 0, missing 0" in out
    assert "tensors no family claims" not in out and out.rstrip().endswith("ok: both implementations load every family present")
