"""The metrics a report row can carry: one table, read by everything that knows a metric by name.

A `Metric` says which way its value is better (`better`: the direction an info row is written
with and a baseline comparison reads it in; '' where the rule that judges a check sets it, as a
count held to "at most" in one check and "exactly" in another, or where the value has no
direction), whether it records a discrete decision the dtype's noise can flip (`decision`: only
those rows may be a `tie_flip`, docs/tolerances.md §3), its unit and what it means. The readers:

* the rules (`parity.compare.verdict.DIFF_METRIC_BETTER`, `better_of`);
* the report fixture: an info row written without `better=` takes the table's (parity/plugin/report_fixture.py);
* the audit (`DECISION_METRICS`, parity/report/audit.py);
* the review page's views (their metric groups, labels and order, parity/report/views.py).

A metric a suite writes is in the table (tests/repo/test_metrics.py holds the suites, the
committed baselines and the lane run to it). A name with `*` stands for a family of names
(`fnmatch`: the benchmarks' `{variant}_ms`); a metric labelled with a code object
(`compiles[TransformerBlock.forward]`) is its base name's. docs/reports.md §4 has the recipe.
"""

from __future__ import annotations

import dataclasses
import fnmatch

# Which way a row's value is better (the report's `better` column).
LOWER, HIGHER, EQUAL = "lower", "higher", "equal"
DIRECTIONS = (LOWER, HIGHER, EQUAL)
BY_RULE = ""  # no direction of its own: the rule that judges it sets one, or the value has none


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric of the report rows."""

    name: str
    better: str  # LOWER, HIGHER, EQUAL or BY_RULE
    decision: bool  # a discrete choice (a greedy token, an expert id) the dtype's noise can flip
    unit: str  # '' for a count or a flag (1 = yes)
    doc: str

    def __post_init__(self) -> None:
        if self.better not in (*DIRECTIONS, BY_RULE):
            raise ValueError(f"metric {self.name}: better must be one of {DIRECTIONS} or '', got {self.better!r}")
        if not self.doc.strip():
            raise ValueError(f"metric {self.name}: a metric needs its one-line meaning")


def _m(name: str, better: str, doc: str, unit: str = "", *, decision: bool = False) -> Metric:
    return Metric(name, better, decision, unit, doc)


# In reading order: the tensor diff's numbers, the golden noise-floor rule's, decisions, the
# suites' counts and flags by family, the localisation's stage rows, the plugin's own rows, the
# benchmarks. The review page lists a view's metrics in this order.
TABLE: tuple[Metric, ...] = (
    # parity.compare.diff.TensorDiff
    _m("max_abs", LOWER, "largest |target - reference| over the output's elements", "abs"),
    _m("mean_abs", LOWER, "mean |target - reference|", "abs"),
    _m("rel_l2", LOWER, "||target - reference|| / ||reference||", "ratio"),
    _m("max_ulp", LOWER, "largest distance in units in the last place of the target's dtype", "ulp"),
    _m("n_bad", LOWER, "elements outside atol + rtol * |reference|"),
    _m("nonfinite_ref", LOWER, "non-finite elements of the reference"),
    _m("nonfinite_cand", LOWER, "non-finite elements of the target"),
    _m("nonfinite_mismatch", LOWER, "elements finite on one side and not on the other"),
    _m("cosine", HIGHER, "cosine similarity of target and reference, flattened", "ratio"),
    _m("argmax_agree", HIGHER, "share of rows whose argmax over the last dim agrees", "ratio"),
    _m("topk_agree", HIGHER, "share of rows whose top-k set over the last dim agrees", "ratio"),
    _m("structure", LOWER, "nested outputs whose structure (keys, lengths, shapes) differs"),
    # the noise-floor rules (parity.compare.rules)
    _m("rmse_vs_golden", LOWER, "RMSE against the fp64 golden, held to the eager reference's own (a measured bound)", "rmse"),
    _m("psnr_vs_golden", HIGHER, "PSNR of the decoded image against the fp64 golden's", "dB"),
    _m("weight_max_abs", LOWER, "largest difference of a router's combine weights", "abs"),
    # decisions the dtype's noise can flip
    _m("matched_steps", HIGHER, "greedy decode steps whose tokens equal the reference's", "steps", decision=True),
    _m("ids_mismatch", LOWER, "expert ids that differ from the reference's choice", decision=True),
    _m("tie_flip_max_margin_ulps", LOWER, "the widest top-k margin among a routing grid point's tie flips", "ulp"),
    # decode (parity/suites/ar/test_decode.py, decode.py)
    _m("compared_steps", EQUAL, "decode steps compared teacher-forced (must be the case's steps)", "steps"),
    _m("crosses_into_gen_tokens", EQUAL, "the case's decode crosses from und into gen tokens (1 = yes)"),
    _m("gen_tokens_generated", BY_RULE, "gen tokens the reference generated", "tokens"),
    _m("tokens", BY_RULE, "a side's greedy sequence length; the ids are in the row's data (`tokens`)", "tokens"),
    _m("step_max_abs", LOWER, "largest step-logits difference over the steps; per step in the row's data (`steps`)", "abs"),
    # numerics, expert selection, embedding clamp (the AR family)
    _m("first_divergence", BY_RULE, "1 when a layer diverged beyond tolerance (which one: the detail)"),
    _m("first_differing_position", EQUAL, "the first position whose expert ids differ (-1: none)"),
    _m("observation_margin", BY_RULE, "a router decision's top-k margin, recorded beside its gate", "ulp"),
    _m("mismatched_tokens", LOWER, "tokens routed to another expert than the reference's"),
    _m("gen_expert_calls", BY_RULE, "calls of the gen expert in a batch (at least one, or exactly N)"),
    _m("gen_expert_calls_without_gen_tokens", EQUAL, "gen expert calls in a batch of text tokens only"),
    _m("und_expert_calls_without_text_tokens", EQUAL, "und expert calls in a batch of gen tokens only"),
    _m("tokens_on_gen_expert", BY_RULE, "tokens the gen expert received", "tokens"),
    _m("moe_layers_match", EQUAL, "the target's MoE layers are the reference's (1 = yes)"),
    _m("out_of_range_indices", LOWER, "embedding indices outside the table after clamping"),
    # fail-closed capture (the capture contract, parity/contract.py)
    _m("capture_refused", EQUAL, "capturing a data-dependent MoE layer is refused (1 = yes)"),
    _m("offers_enforce_eager", EQUAL, "the refusal offers eager execution (1 = yes)"),
    _m("says_piecewise_is_not_a_workaround", EQUAL, "the refusal says piecewise capture does not help (1 = yes)"),
    _m("names_the_layer", EQUAL, "the refusal names the MoE layer by its module path (1 = yes)"),
    _m("finite_logits", EQUAL, "an eager forward on embeddings alone gives finite logits (1 = yes)"),
    _m("missing_probe_warnings", EQUAL, "warnings for a capture backend whose probe was removed (exactly one per process)"),
    _m("requires_raw_input_tokens", EQUAL, "the model declares it needs raw token ids (1 = yes)"),
    _m("distance_from_ids_dropped", HIGHER, "how far the multimodal entry's logits are from an embeddings-only forward", "abs"),
    _m("gen_token_mask_seeded", EQUAL, "the gen-token mask is seeded before capture (1 = yes)"),
    _m("factory_installed", EQUAL, "the pipeline-parallel factory is installed (1 = yes)"),
    # weight coverage
    _m("unused_tensors", LOWER, "checkpoint tensors the target never reads"),
    _m("unreceived_tensors", LOWER, "parameters no checkpoint tensor was loaded into"),
    _m("misplaced_tensors", LOWER, "checkpoint tensors loaded into another parameter than their own"),
    _m("unattributed_parameters", LOWER, "parameters no checkpoint tensor accounts for"),
    _m("fraction_read", HIGHER, "share of the checkpoint's bytes the target read", "ratio"),
    # recompiles (parity.observe.compile_ledger; labelled per code object: `compiles[Block.forward]`)
    _m("compiles", BY_RULE, "Dynamo compiles so far (cumulative over a lattice of shapes)"),
    _m("new_compiles", BY_RULE, "compiles a shape added"),
    _m("recompiles", BY_RULE, "recompiles so far, with Dynamo's reasons in the detail"),
    _m("calls", BY_RULE, "calls of a compiled code object"),
    _m("graph_breaks", LOWER, "graph breaks of a compiled forward"),
    _m("eager_fallback", LOWER, "modules that fell back to eager"),
    _m("block_compiles", HIGHER, "compiles of the regionally compiled block"),
    _m("block_modules", HIGHER, "submodules of the block class found for regional compilation"),
    _m("regional_modules_compiled", HIGHER, "modules compiled by regional compilation"),
    _m("control_frame_compiles", HIGHER, "compiles of a frame outside the block region (the ledger sees other frames)"),
    # the DiT family: sampler, image
    _m("timesteps_shape", EQUAL, "the sampler's timesteps have the expected shape (1 = yes)"),
    _m("shift", EQUAL, "the schedule shift the target's timesteps imply (the reference's in the detail)"),
    _m("cfg_trace", EQUAL, "classifier-free guidance followed the reference's branches (1 = yes)"),
    _m("latents_dtype", EQUAL, "latents keep the reference's dtype (1 = yes)"),
    _m("ref_rms", BY_RULE, "RMS of the reference's output: the scale the DiT's diffs are read against", "rms"),
    _m("mismatched_elements", LOWER, "elements that differ where equality is required"),
    _m("psnr", HIGHER, "peak signal-to-noise ratio of an image against the reference's", "dB"),
    _m("ssim", HIGHER, "structural similarity of an image against the reference's", "ratio"),
    # routing (parity/suites/routing)
    _m("contract_violations", LOWER, "outputs of select_experts that break the routing contract"),
    _m("load_mismatch", LOWER, "experts whose token load differs from the reference's"),
    _m("remap_mismatch", LOWER, "physical expert ids that differ after remapping"),
    _m("minus_one_changed", LOWER, "dropped (-1) ids a remap changed"),
    _m("pad_routes", LOWER, "pad rows routed to an expert"),
    _m("reference_refuses", EQUAL, "the reference refuses the case (1 = yes)"),
    _m("refused_or_ungrouped", EQUAL, "the target refuses or routes ungrouped where the reference refuses (1 = yes)"),
    _m("probe_during_capture", BY_RULE, "the capture probe said capturing (1 = yes)"),
    _m("capture", BY_RULE, "a capture of the router that raised (an error row)"),
    _m("ranks_disagree", LOWER, "tensor-parallel ranks whose routing differs"),
    _m("rows_misaligned", LOWER, "rows a rank holds at another place than rank 0"),
    _m("counts_mismatch", LOWER, "expert counts that differ between ranks"),
    _m("rank_run", BY_RULE, "a tensor-parallel rank run that raised (an error row)"),
    # selfcheck (the harness checks itself)
    _m("cosine_error", LOWER, "1 - cosine of a planted difference, measured against its known value", "ratio"),
    _m("psnr_error_db", LOWER, "error of the PSNR against its known value", "dB"),
    _m("ulp_distance", EQUAL, "ULP distance of planted values (known)", "ulp"),
    _m("review_findings", BY_RULE, "what the review finds in planted rows (at least one, or none)"),
    # the mutant catalogues (parity/suites/sensitivity)
    _m("killed", EQUAL, "the mutant was killed by the suite that must kill it (1 = yes)"),
    _m("false_alarms", LOWER, "suites that failed on the unmutated control"),
    _m("localised_stage", EQUAL, "the localisation named the stage the mutant was planted in (1 = yes)"),
    # the localisation's stage chain (parity.localise.rows)
    _m("stage_rmse_vs_golden", LOWER, "a float stage's RMSE against the fp64 golden (bound: the reference's own)", "rmse"),
    _m("stage_mismatches", LOWER, "entries of an exact stage (ids, masks) that differ from the reference"),
    _m("first_diverging_stage", BY_RULE, "1 when a stage was blamed (the site; repro and summary in the row's data)"),
    _m("compile_only_piece", BY_RULE, "1 when a compiled piece alone differs from itself run eagerly (the site)"),
    # rows the plugin writes
    _m("skipped", BY_RULE, "a suite test pytest skipped (its reason in the detail)"),
    _m("exception", BY_RULE, "a check that raised (its type, place and message in the detail)"),
    _m("assertion", BY_RULE, "a bare assert that failed"),
    _m("family_not_provided", BY_RULE, "tests of a family the target does not provide (value: how many)", "tests"),
    # benchmarks (parity/suites/benchmarks): timings recorded, ratios judged
    _m("copy_bandwidth_gb_s", HIGHER, "device memory copy bandwidth", "GB/s"),
    _m("device_name", BY_RULE, "the card a benchmark timed on (in the detail)"),
    _m("graph_picked_for_text_batch", BY_RULE, "the decode graph the target picks for a text batch (in the detail)"),
    _m("launches_per_step", BY_RULE, "kernel launches (ATen ops on the CPU) of a profiled decode step, a mean", "launches"),
    _m("first_compiled_call_s", BY_RULE, "the first compiled call, Inductor compilation included", "s"),
    _m("blend_tax", LOWER, "graph blend / graph single-expert step", "ratio"),
    _m("blend_tax_vs_bytes", LOWER, "blend_tax over the ratio of bytes the two steps read", "ratio"),
    _m("und_only_vs_single", LOWER, "graph und-only / graph single-expert step", "ratio"),
    _m("gen_only_vs_single", LOWER, "graph gen-only / graph single-expert step", "ratio"),
    _m("blend_vs_eager_single", LOWER, "graph blend / eager single-expert step", "ratio"),
    _m("*speedup*", HIGHER, "a time over a faster variant's time", "ratio"),
    _m("hbm_floor_ratio_*", LOWER, "a step's time over the time to read its bytes at the copy bandwidth", "ratio"),
    _m("gqa_vs_repeat_kv_*", LOWER, "native GQA over K/V repeated per query head (time or memory)", "ratio"),
    _m("*_ms", BY_RULE, "a median time, recorded beside the ratios that judge it", "ms"),
    _m("*_mib", BY_RULE, "a peak memory, recorded beside the ratios that judge it", "MiB"),
)

METRICS: dict[str, Metric] = {metric.name: metric for metric in TABLE}
_PATTERNS = tuple(metric for metric in TABLE if "*" in metric.name)


def base_name(metric: str) -> str:
    """`compiles` for `compiles[TransformerBlock.forward]` (a metric labelled with a code object)."""
    return metric.split("[", 1)[0]


def lookup(metric: str) -> Metric | None:
    """The table's entry for a row's metric (a labelled one by its base name, a benchmark's by its
    family pattern); None for a metric the table does not know."""
    name = base_name(metric)
    found = METRICS.get(name)
    if found is not None:
        return found
    return next((entry for entry in _PATTERNS if fnmatch.fnmatchcase(name, entry.name)), None)


def metric(name: str) -> Metric:
    """The table's entry for `name`; KeyError (naming the table) for a metric it does not know."""
    found = lookup(name)
    if found is None:
        raise KeyError(f"metric {name!r} is not in parity.compare.metrics.TABLE: add it there (docs/reports.md §4)")
    return found


def default_better(name: str) -> str:
    """The direction an info row of `name` is written with when its writer gives none: the table's
    ('' for a metric the table does not know: a suite of your own may name its own metrics)."""
    found = lookup(name)
    return found.better if found is not None else BY_RULE


# The metrics whose gate row decides a discrete choice (docs/tolerances.md §3: only these can be a
# `tie_flip`; on any other row the verdict would excuse a plain failure).
DECISION_METRICS = tuple(entry.name for entry in TABLE if entry.decision)
