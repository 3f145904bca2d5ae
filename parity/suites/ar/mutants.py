"""AR mutants of the sensitivity catalogue (vllm-project/vllm-omni#7318, #9764, #9851, #7319, #7432 and ports' slips).

Each entry is registered with `parity.suites.sensitivity.catalogue` and is a `--target` factory:
`--target parity.suites.ar.mutants:mutant_<name with _ for ->`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable

from parity.suites.sensitivity.catalogue import RUNNERS, Kill, factory_lookup, mutant
from parity.suites.sensitivity.catalogue import patch as _patch

__getattr__ = factory_lookup(__name__)

AR = "serving_models.ar.model"
EXPERT_SELECTION = "parity/suites/ar/test_expert_selection.py"


# ---------------------------------------------------------------------------------------------
# AR backbone (vllm-project/vllm-omni#7318, #9764, #9851, #7319, #7432)
# ---------------------------------------------------------------------------------------------


@mutant(
    "multimodal-drops-input-ids",
    defect="the runner's multimodal entry passes inputs_embeds only: mask None, every token on the und expert (vllm-project/vllm-omni#9851)",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "multimodal and not compiled"),
)
def _drop_input_ids() -> None:
    from serving_models.ar import runner as ar_runner

    original = ar_runner.prepare_model_inputs

    def prepare_model_inputs(model, input_ids, inputs_embeds):
        inputs = original(model, input_ids, inputs_embeds)
        if inputs_embeds is not None:
            inputs["input_ids"] = None
        return inputs

    ar_runner.prepare_model_inputs = prepare_model_inputs


@mutant(
    "host-branch-dispatch-under-capture",
    defect="the eager any/all dispatch stays active under capture, so the dummy batch's branch is what a graph holds (vllm-project/vllm-omni#7318)",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "test_expert_selection and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "test_expert_selection and cuda_graph"),
)
def _host_branch_dispatch() -> None:
    ar = importlib.import_module(AR)

    def moe_dispatch(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name):
        if gen_expert is None:
            return und_expert(hidden_states)
        return ar.moe_eager(hidden_states, und_expert, gen_expert, gen_token_mask)

    ar.moe_dispatch = moe_dispatch


@mutant(
    "dispatch-from-stale-host-metadata",
    defect=(
        "the expert dispatch branches on host-side batch metadata (has gen tokens / all gen) refreshed only "
        "outside capture: the graph captured after warm-up on the all-zero dummy batch bakes the und expert "
        "and replays it for every real token (vllm-project/vllm-omni#7318 as shipped)"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "test_expert_selection and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "test_expert_selection and cuda_graph"),
)
def _stale_host_metadata() -> None:
    import torch

    ar = importlib.import_module(AR)
    from serving_models.common import capture

    host = {"has_gen": False, "all_gen": False}  # the runner's per-step metadata, kept on the host

    def moe_dispatch(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name):
        if gen_expert is None:
            return und_expert(hidden_states)
        capturing = torch.compiler.is_compiling() or capture.is_capturing(hidden_states.device)
        if gen_token_mask is not None and not capturing:
            mask = gen_token_mask.cpu()  # a host read, legal outside capture: refreshes the metadata
            host.update(has_gen=bool(mask.any()), all_gen=bool(mask.all()))
        if not host["has_gen"]:
            return und_expert(hidden_states)
        if host["all_gen"]:
            return gen_expert(hidden_states)
        return ar.moe_blend(hidden_states, und_expert, gen_expert, gen_token_mask)

    ar.moe_dispatch = moe_dispatch


@mutant(
    "mixed-batch-on-und-only-graph",
    defect=(
        "the runner keys a decode batch blend only when every request is generating an image ('all' for 'any'): "
        "a mixed batch replays the und-only graph and its gen tokens get the und expert (vllm-project/vllm-omni#9865's "
        "mask-keyed graphs, keyed wrong)"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "keyed_decode and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "keyed_decode and cuda_graph"),
)
def _mixed_batch_on_und_only() -> None:
    from serving_models.ar import runner as ar_runner

    def decode_graph_key(generating):
        flags = [bool(flag) for flag in generating]
        return ar_runner.BLEND if flags and all(flags) else ar_runner.UND_ONLY

    ar_runner.decode_graph_key = decode_graph_key


@mutant(
    "text-decode-replays-blend",
    defect=(
        "every decode batch replays the blended graph: tokens stay right, but text-only batches pay both experts "
        "(the blend tax of vllm-project/vllm-omni#9764 that mask-keyed graphs remove)"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "keyed_decode and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "keyed_decode and cuda_graph"),
)
def _always_blend() -> None:
    from serving_models.ar import runner as ar_runner

    ar_runner.decode_graph_key = lambda generating: ar_runner.BLEND


@mutant(
    "mixed-batch-on-gen-only-graph",
    defect=(
        "the runner keys a decode batch gen-only as soon as one request is generating an image ('any' for 'all'): "
        "a mixed batch replays the gen-only graph and its text tokens get the gen expert (vllm-project/vllm-omni#9865's "
        "all-gen graph, keyed wrong)"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "keyed_decode and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "keyed_decode and cuda_graph"),
)
def _mixed_batch_on_gen_only() -> None:
    from serving_models.ar import runner as ar_runner

    def decode_graph_key(generating):
        return ar_runner.GEN_ONLY if any(flag is True for flag in generating) else ar_runner.UND_ONLY

    ar_runner.decode_graph_key = decode_graph_key


@mutant(
    "image-batch-on-und-only-graph",
    defect=(
        "the runner asks only whether a decode batch is mixed and keys every single-kind batch und-only: a batch of "
        "image requests replays the und-only graph and its gen tokens get the und expert"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "keyed_decode and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "keyed_decode and cuda_graph"),
)
def _image_batch_on_und_only() -> None:
    from serving_models.ar import runner as ar_runner

    def decode_graph_key(generating):
        flags = {None if flag is None else bool(flag) for flag in generating}
        return ar_runner.UND_ONLY if len(flags) <= 1 and None not in flags else ar_runner.BLEND

    ar_runner.decode_graph_key = decode_graph_key


@mutant(
    "image-decode-replays-blend",
    defect=(
        "the runner keeps two decode graphs and keys every batch with an image request blend: tokens stay right, "
        "but a batch of image requests pays both experts (the blend tax the gen-only graph removes)"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "keyed_decode and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "keyed_decode and cuda_graph"),
)
def _image_decode_blend() -> None:
    from serving_models.ar import runner as ar_runner

    ar_runner.decode_graph_key = lambda generating: (
        ar_runner.UND_ONLY if all(flag is False for flag in generating) else ar_runner.BLEND
    )


@mutant(
    "unknown-row-keyed-as-text",
    defect=(
        "the runner reads a request whose next token's kind the host does not know (None: it may have sampled "
        "image_start) as text: a batch of such rows and text rows replays the und-only graph, and a gen token there "
        "gets the und expert (the rows of unknown kind must replay the blend)"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "keyed_decode and cpu_graph"),
    cuda=(EXPERT_SELECTION, "-k", "keyed_decode and cuda_graph"),
)
def _unknown_row_as_text() -> None:
    from serving_models.ar import runner as ar_runner

    original = ar_runner.decode_graph_key
    ar_runner.decode_graph_key = lambda generating: original([flag is True for flag in generating])


@mutant(
    "capture-without-mask-fails-open",
    defect="capturing without a mask silently runs the und expert for every token instead of raising (vllm-project/vllm-omni#9764)",
    suite="fail_closed_capture",
    tests=("parity/suites/ar/test_fail_closed_capture.py", "-k", "capture_without_mask"),
)
def _fail_open() -> None:
    ar = importlib.import_module(AR)
    original = ar.moe_dispatch

    def moe_dispatch(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name):
        if gen_token_mask is None:
            return und_expert(hidden_states)
        return original(hidden_states, und_expert, gen_expert, gen_token_mask, layer_name)

    ar.moe_dispatch = moe_dispatch


@mutant(
    "no-clamp-gen-side",
    defect="the gen-table index is id - start unclamped: text ids and the -1 sentinel index out of range on the discarded side (vllm-project/vllm-omni#7432)",
    suite="embedding_clamp",
    tests=("parity/suites/ar/test_embedding_clamp.py", "-k", "in_range_indices and not compiled"),
)
def _no_clamp_gen() -> None:
    _patch(AR, "clamp_gen_ids", lambda input_ids, start, gen_vocab_size: input_ids - start)


@mutant(
    "no-clamp-base-side",
    defect="the base-table index is the raw id: gen ids and the -1 sentinel index out of range on the discarded side (vllm-project/vllm-omni#7319)",
    suite="embedding_clamp",
    tests=("parity/suites/ar/test_embedding_clamp.py", "-k", "in_range_indices and not compiled"),
)
def _no_clamp_base() -> None:
    _patch(AR, "clamp_base_ids", lambda input_ids, base_vocab_size: input_ids)


def _patch_moe_enable(rule: Callable[[int, int, int], bool]) -> None:
    from serving_models.ar import config as ar_config

    original = ar_config.moe_enable

    def moe_enable(moe_type: str, layer_type: str, layer_idx: int) -> bool:
        if ":" not in moe_type:
            return original(moe_type, layer_type, layer_idx)
        kind, _, span = moe_type.partition("-")
        start, end = (int(v) for v in span.split(":"))
        return layer_type in kind and rule(start, end, layer_idx)

    ar_config.moe_enable = moe_enable


@mutant(
    "moe-range-inclusive",
    defect="moe_type's 'a:b' read as inclusive, enabling the gen expert one layer past the range",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "moe_type"),
)
def _moe_inclusive() -> None:
    _patch_moe_enable(lambda start, end, i: start <= i <= end)


@mutant(
    "moe-range-shifted",
    defect="moe_type's range shifted by one layer (1-based reading)",
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "moe_type"),
)
def _moe_shifted() -> None:
    _patch_moe_enable(lambda start, end, i: start <= i - 1 < end)


@mutant(
    "gen-mlp-never-called",
    defect="gen_mlp weights load and are never called: every token on the und expert (the 42 unused tensors of vllm-project/vllm-omni#9764)",
    suite="weight_coverage",
    tests=("parity/suites/ar/test_weight_coverage.py", "-k", "target"),
)
def _gen_never_called() -> None:
    _patch(
        AR, "moe_dispatch", lambda hidden_states, und_expert, gen_expert, gen_token_mask, layer_name: und_expert(hidden_states)
    )


@mutant(
    "decode-resets-mask",
    defect="decode steps drop the mask (UP3's prepare_inputs_for_generation reset misused): decode routes every token to the und expert",
    suite="decode",
    tests=("parity/suites/ar/test_decode.py", "-k", "eager"),
    stage="layer.2.moe",
)
def _decode_resets_mask() -> None:
    ar = importlib.import_module(AR)
    lm = ar.MammothModa2Qwen2ForCausalLM
    original = lm.forward

    def forward(
        self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, gen_token_mask=None, kv_cache=None, **kw
    ):
        if kv_cache is not None and input_ids is not None and input_ids.shape[1] == 1:
            inputs_embeds, input_ids = self.get_input_embeddings(input_ids), None
        return original(self, input_ids, positions, intermediate_tensors, inputs_embeds, gen_token_mask, kv_cache, **kw)

    lm.forward = forward


@mutant(
    "greedy-gen-column-as-token",
    defect=(
        "greedy decoding hands back the argmax logits column as the token id: right while the gen start is "
        "the text table's size, but in the Dev layout (docs/checkpoints.md §4) every gen token comes out as "
        "an id of neither table"
    ),
    suite="decode",
    tests=("parity/suites/ar/test_decode.py", "-k", "greedy and dev-layout and eager"),
    stage_note=(
        "the step logits are right (teacher-forced decode passes); the defect is the token read off them, after "
        "the heads, which no stage holds: matched_steps names the step and both tokens"
    ),
)
def _gen_column_as_token() -> None:
    from serving_models.ar import config as ar_config

    ar_config.MammothModa2ARConfig.token_of_column = lambda self, column: column


def _probe_warning(every_call: bool) -> None:
    from serving_models.common import capture

    def is_capturing(device) -> bool:
        backend = capture._backend_name(device)
        probe = capture._probes.get(backend)
        if probe is None:
            if every_call:
                warnings.warn(f"backend {backend!r} has no capture probe", capture.MissingCaptureProbeWarning, stacklevel=2)
            return False
        return bool(probe())

    capture.is_capturing = is_capturing


@mutant(
    "probe-warning-every-call",
    defect="the missing-probe warning fires on every call (log spam on NPU/XPU backends)",
    suite="fail_closed_capture",
    tests=("parity/suites/ar/test_fail_closed_capture.py", "-k", "missing_probe"),
)
def _warn_every_call() -> None:
    _probe_warning(every_call=True)


@mutant(
    "probe-warning-never",
    defect="a backend without a capture probe silently reports 'not capturing' (no warning)",
    suite="fail_closed_capture",
    tests=("parity/suites/ar/test_fail_closed_capture.py", "-k", "missing_probe"),
)
def _warn_never() -> None:
    _probe_warning(every_call=False)


@mutant(
    "probe-warning-once-per-model",
    defect=(
        "the missing-probe warning's 'once' is kept per model instance (a flag the model owns): every "
        "pipeline stage or engine rebuilt in the process warns again (vllm-project/vllm-omni#9764 specifies once per process)"
    ),
    suite="fail_closed_capture",
    tests=("parity/suites/ar/test_fail_closed_capture.py", "-k", "missing_probe"),
)
def _warn_once_per_model() -> None:
    from serving_models.common import capture

    ar = importlib.import_module(AR)
    top = ar.MammothModa2ForConditionalGeneration
    original = top.forward

    def forward(self, *args, **kwargs):
        process_wide = capture._warned
        capture._warned = self.__dict__.setdefault("_missing_probe_warned", set())  # the instance's own "once"
        try:
            return original(self, *args, **kwargs)
        finally:
            capture._warned = process_wide

    top.forward = forward


@mutant(
    "replay-without-copy-in",
    defect="a decode step replayed without copying the new inputs into the graph's static buffers (stale replay)",
    suite="decode",
    tests=("parity/suites/ar/test_decode.py", "-k", "cpu_graph"),
    cuda=("parity/suites/ar/test_decode.py", "-k", "cuda_graph"),
    family=RUNNERS,
    stage="embed",
)
def _no_copy_in() -> None:
    from parity.runners.graph import GraphRun  # the copy-in both graph modes share

    GraphRun._copy_in = lambda self, inputs: None


@mutant(
    "rmsnorm-eps-1e-5",
    defect="RMSNorm eps 1e-5 (UP25's class default) instead of the release's 1e-6 in the serving model: a small numeric drift",
    suite="numerics",
    tests=("parity/suites/ar/test_numerics.py", "-k", "layer_by_layer and eager"),
    cuda=Kill(
        ("parity/suites/ar/test_numerics.py", "-k", "layer_by_layer and eager"),
        dtype="fp32",
        why=(
            "in bf16 the eps change (1e-5 vs 1e-6 added to mean squares of order 1) moves activations by about "
            "1e-6 relative, far inside bf16 rounding (2^-8): an equivalent mutant at bf16, so the CUDA lane checks it in fp32"
        ),
    ),
    stage="layer.0.input_norm",
)
def _rmsnorm_eps() -> None:
    ar = importlib.import_module(AR)
    original = ar.RMSNorm.__init__

    def __init__(self, hidden_size, eps=1e-6, *args, **kwargs):
        original(self, hidden_size, 1e-5, *args, **kwargs)

    ar.RMSNorm.__init__ = __init__


# ---------------------------------------------------------------------------------------------
# Weights and numerics: loader maps and config values a port gets wrong (visible since random
# checkpoints draw biases and norm weights, reference_models/checkpoints.py)
# ---------------------------------------------------------------------------------------------

NUMERICS_EAGER = ("parity/suites/ar/test_numerics.py", "-k", "layer_by_layer and eager")


def _patch_checkpoint_names(rewrite: Callable[[str, list[str]], list[str]]) -> None:
    weights = importlib.import_module("serving_models.ar.weights")
    original = weights.checkpoint_names_for
    weights.checkpoint_names_for = lambda serving_name: rewrite(serving_name, original(serving_name))


@mutant(
    "qkv-bias-shards-swapped",
    defect=(
        "the loader's stacked-parameter map stacks the fused q|k|v bias as q|v|k (the weights in the right "
        "order): keys carry the value bias and values the key bias; every tensor is read, and with zero "
        "biases the outputs were identical"
    ),
    suite="numerics",
    tests=NUMERICS_EAGER,
    stage="layer.0.k",
)
def _qkv_bias_swapped() -> None:
    def rewrite(name: str, parts: list[str]) -> list[str]:
        return [parts[0], parts[2], parts[1]] if name.endswith("qkv_proj.bias") else parts

    _patch_checkpoint_names(rewrite)


@mutant(
    "experts-loaded-swapped",
    defect=(
        "the loader's name map fills the first MoE layer's und expert from gen_mlp's tensors and its gen expert from "
        "mlp's: every tensor is read and every token takes the expert its id asks for, with the other expert's weights; "
        "an observation through the target's own experts calls it right"
    ),
    suite="expert_selection",
    tests=(EXPERT_SELECTION, "-k", "test_expert_selection and eager"),
)
def _experts_loaded_swapped() -> None:
    swap = {".layers.2.mlp.": ".layers.2.gen_mlp.", ".layers.2.gen_mlp.": ".layers.2.mlp."}

    def rewrite(name: str, parts: list[str]) -> list[str]:
        for old, new in swap.items():
            if old in name:
                return [part.replace(old, new) for part in parts]
        return parts

    _patch_checkpoint_names(rewrite)


@mutant(
    "layernorm-weights-swapped",
    defect=(
        "the loader maps input_layernorm.weight to post_attention_layernorm and back (a name-mapping slip of a "
        "fused add+norm port): every tensor is read, and with unit norm weights the outputs were identical"
    ),
    suite="numerics",
    tests=NUMERICS_EAGER,
    stage="layer.0.input_norm",
)
def _layernorms_swapped() -> None:
    swap = {
        "input_layernorm.weight": "post_attention_layernorm.weight",
        "post_attention_layernorm.weight": "input_layernorm.weight",
    }

    def rewrite(name: str, parts: list[str]) -> list[str]:
        for old, new in swap.items():
            if name.endswith(old):
                return [parts[0].removesuffix(old) + new]
        return parts

    _patch_checkpoint_names(rewrite)


@mutant(
    "rope-theta-default",
    defect="the serving RoPE built with the default theta 10000 instead of the config's rope_theta (1e6 in Qwen2.5 backbones)",
    suite="numerics",
    tests=NUMERICS_EAGER,
    cuda=Kill(
        NUMERICS_EAGER,
        dtype="fp32",
        why=(
            "at the numerics prompts' positions (at most 12) the two thetas' angles are close: the first layer moves by "
            "RMSE 3.9e-5 (tiny, fp32), inside bf16's noise there (the bf16 bound is about 3.4e-4): an equivalent "
            "mutant at bf16, so the CUDA lane checks it in fp32"
        ),
    ),
    stage="layer.0.q_rope",
)
def _rope_theta_default() -> None:
    ar = importlib.import_module(AR)
    original = ar.RotaryEmbedding.__init__

    def __init__(self, head_dim: int, theta: float) -> None:
        original(self, head_dim, 10000.0)

    ar.RotaryEmbedding.__init__ = __init__


# ---------------------------------------------------------------------------------------------
# Decode positions
# ---------------------------------------------------------------------------------------------

# The longest decode-case prompt (cases/ar.toml) has 8 tokens: position 17 is decoded at step 10
# for it and later for the shorter ones, so steps 0-9 of every case are exact (tests/support/decode_targets.py).
LATE_BAD_POSITION = 17


def _patch_decode_positions(change: Callable) -> None:
    from serving_models.ar import adapter

    original = adapter.ServingARAdapter.decode_step  # the plain function (a traceable_method)

    def decode_step(self, input_ids, positions):
        return original(self, input_ids, change(positions))

    adapter.ServingARAdapter.decode_step = adapter.traceable_method(decode_step)


@mutant(
    "decode-position-saturates-late",
    defect=(
        f"decode positions saturate at {LATE_BAD_POSITION - 1} (a position clamped at a block or capacity boundary): "
        f"from position {LATE_BAD_POSITION} on every token overwrites one KV slot and reuses its RoPE angle; steps 0-9 "
        "are exact, so only decode evidence after step 8 shows it (teacher-forced buckets 8-15 on)"
    ),
    suite="decode",
    tests=("parity/suites/ar/test_decode.py", "-k", "teacher_forced and eager"),
    cuda=("parity/suites/ar/test_decode.py", "-k", "teacher_forced and cuda_graph"),
    stage="layer.0.q_rope",
)
def _late_position_saturation() -> None:
    _patch_decode_positions(lambda positions: positions.clamp(max=LATE_BAD_POSITION - 1))


@mutant(
    "decode-position-off-by-one",
    defect="the decode step is given position L+i instead of L+i-1 (a sequence length used as the position): a KV slot is skipped and every RoPE angle is one ahead",
    suite="decode",
    tests=("parity/suites/ar/test_decode.py", "-k", "teacher_forced and eager"),
    stage="layer.0.q_rope",
)
def _position_off_by_one() -> None:
    _patch_decode_positions(lambda positions: positions + 1)


# ---------------------------------------------------------------------------------------------
# Runners: how the harness's compiled and graph modes serve a step (as an engine's runner does)
# ---------------------------------------------------------------------------------------------


@mutant(
    "compiled-runner-static-shapes",
    defect=(
        "the compiled mode compiles with dynamic=False where a serving engine compiles the step with dynamic "
        "shapes: every new batch size or length recompiles until the recompile limit, then runs eager; "
        "the outputs stay right, so every numeric suite passes"
    ),
    suite="recompiles",
    tests=("parity/suites/ar/test_recompiles.py",),
    family=RUNNERS,
)
def _static_shapes() -> None:
    import dataclasses

    from parity.runners import compiled

    original = compiled.compile_function

    def compile_function(fn, options, ledger):
        return original(fn, dataclasses.replace(options, dynamic=False), ledger)

    compiled.compile_function = compile_function


# ---------------------------------------------------------------------------------------------
# Sharding: the tensor-parallel serving AR at tp 2 (serving_models/ar/sharded.py), the splits
# real ports get wrong while every tensor still loads
# ---------------------------------------------------------------------------------------------

SHARDED = "serving_models.ar.sharded"
NUMERICS = "parity/suites/ar/test_numerics.py"
MIXED_EAGER = (NUMERICS, "-k", "test_target_matches_reference_layer_by_layer and mixed and eager")


@mutant(
    "tp-fused-shards-stacked-whole",
    defect=(
        "the sharding loader slices the stacked q|k|v and gate|up weights into contiguous rank blocks instead of "
        "splitting each projection and stacking the rank's pieces: rank 0 holds all of q, rank 1 k and v; shapes match"
    ),
    suite="numerics",
    tests=MIXED_EAGER,
    tp=2,
)
def _fused_shards_stacked_whole() -> None:
    import torch

    def column_shard(parts, rank, world_size):
        return torch.cat(parts, dim=0).chunk(world_size, dim=0)[rank]

    _patch(SHARDED, "column_shard", column_shard)


@mutant(
    "tp-residual-added-on-every-rank",
    defect=(
        "o_proj's fused residual (the additive term of a row-parallel output, where a bias would go) is added on "
        "every rank before the all-reduce instead of once after it: counted tp times"
    ),
    suite="numerics",
    tests=MIXED_EAGER,
    tp=2,
)
def _residual_on_every_rank() -> None:
    def row_parallel_output(partial, residual, tp):
        return tp.all_reduce(partial if residual is None else partial + residual)

    _patch(SHARDED, "row_parallel_output", row_parallel_output)


@mutant(
    "tp-vocab-lookup-unmasked",
    defect=(
        "the vocabulary-parallel lookup clamps ids outside its rows into its own block and adds those rows "
        "instead of zero: every token's embedding is the sum of one row per rank"
    ),
    suite="numerics",
    tests=MIXED_EAGER,
    tp=2,
)
def _vocab_lookup_unmasked() -> None:
    import torch.nn.functional as F

    def vocab_shard_lookup(indices, weight, lo, hi):
        return F.embedding((indices - lo).clamp(0, hi - lo - 1), weight)

    _patch(SHARDED, "vocab_shard_lookup", vocab_shard_lookup)


@mutant(
    "tp-gen-expert-not-reduced",
    defect=(
        "the gen expert's row-parallel down projection skips its all-reduce (the und expert's keeps it): every "
        "gen token's MoE output is one rank's partial sum"
    ),
    suite="numerics",
    tests=MIXED_EAGER,
    tp=2,
)
def _gen_expert_not_reduced() -> None:
    _patch(SHARDED, "expert_reduces", lambda expert: expert != "gen_mlp")


@mutant(
    "tp-gen-table-at-base-boundary",
    defect=(
        "the sharded gen lookup places the gen table's rows at the text table's boundary (vocab_size) instead of "
        "the gen vocabulary's own start: equal in Preview's layout, the wrong gen rows in Dev's (docs/checkpoints.md §4)"
    ),
    suite="numerics",
    tests=(NUMERICS, "-k", "test_text_table_shorter_than_gen_start"),
    tp=2,
)
def _gen_table_at_base_boundary() -> None:
    ar = importlib.import_module(AR)

    def gen_table_rows(input_ids, config):
        return ar.clamp_gen_ids(input_ids, config.vocab_size, config.gen_vocab_size)

    _patch(SHARDED, "gen_table_rows", gen_table_rows)
