"""fail_closed_capture: a capture that cannot route must refuse, loudly and with the right advice.

vllm-project/vllm-omni#9764: with embeddings but no ids there is no gen mask; capturing then would bake the
understanding expert for every token, so the target must raise a RuntimeError that names the
layer, offers enforce_eager and says PIECEWISE is not a workaround (PIECEWISE pieces hold the MoE
too). Eager without a mask keeps running (the upstream behaviour). A backend without a capture
probe warns once per process (pinned with three model instances in one process). The attribute that keeps ids on the multimodal path,
`requires_raw_input_tokens`, is checked as an attribute and by behaviour; the pipeline-parallel
factory the constructor installs must seed the mask.
"""

from __future__ import annotations

import sys

import pytest
import torch

from parity.compare import AT_LEAST, EXACTLY, count_rule, diff, flag_rule, threshold_rule
from parity.contract import REFUSAL_PHRASES, requirement
from parity.env import PROJECT_ROOT
from parity.observe.progress import run_watched
from parity.runners import CaptureError, make_runner
from parity.suites.ar import fail_closed_cases
from parity.suites.ar.support import PROMPTS, TOL, moe_taps, observe_expert_use, record_policy_not_applicable
from parity.suites.conftest import require_graph_support

pytestmark = pytest.mark.parity_suite("fail_closed_capture")

# What the refusal must contain, by row metric: the words of docs/targets.md §3.1 (parity.contract).
REQUIRED_PHRASES = REFUSAL_PHRASES


def _record_refusal(report, target, mode: str, refused: bool, message: str, kind: str) -> None:
    report.verdict(
        flag_rule(refused, metric="capture_refused", detail=f"{kind}: {message[:600]}"),
        case="capture-without-mask",
        mode=mode,
    )
    where = dict(case="capture-without-mask", mode=mode)
    if record_policy_not_applicable(report, target, "refusal_wording", metrics=list(REQUIRED_PHRASES), **where):
        return
    for metric, phrase in REQUIRED_PHRASES.items():
        present = phrase in message
        report.verdict(
            flag_rule(present, metric=metric, detail=f"looked for {phrase!r} in the refusal ({requirement(metric).cite})"),
            case="capture-without-mask",
            mode=mode,
        )


def _child_env(monkeypatch, settings, device: str) -> None:
    monkeypatch.setenv(fail_closed_cases.ENV_TARGET, settings.target)
    monkeypatch.setenv(fail_closed_cases.ENV_SEED, str(settings.seed))
    monkeypatch.setenv(fail_closed_cases.ENV_DEVICE, device)
    monkeypatch.setenv(fail_closed_cases.ENV_LAYOUT, settings.checkpoint_layout)


@pytest.mark.parametrize("mode", ["cpu_graph", "cuda_graph"])
def test_capture_without_mask_fails_closed(mode: str, ar_models, report, settings, target, monkeypatch) -> None:
    require_graph_support(ar_models.target, mode)
    if mode == "cpu_graph":
        if settings.device != "cpu":
            pytest.skip("cpu_graph is the CPU lane's stand-in")
        case = fail_closed_cases.capture_without_mask_case(target, ar_models.target, ar_models.device)
        runner = make_runner("cpu_graph", device="cpu", capture_registry=case.capture_registry)
        try:
            runner.prepare(case.fn, case.example_inputs, name=case.name).close()
            refused, message, kind = False, "the capture succeeded: und expert baked for every token", "captured"
        except (CaptureError, RuntimeError) as error:
            cause = error.__cause__ if isinstance(error, CaptureError) and error.__cause__ is not None else error
            refused = isinstance(cause, RuntimeError)
            message, kind = str(cause), type(cause).__name__
        _record_refusal(report, target, mode, refused, message, kind)
        return
    if settings.device != "cuda":
        pytest.skip("cuda_graph needs --device cuda")
    from parity.runners.capture_isolated import capture_in_subprocess

    _child_env(monkeypatch, settings, "cuda")
    outcome = capture_in_subprocess(
        "parity.suites.ar.fail_closed_cases:capture_without_mask", mode="cuda_graph", device="cuda", cwd=PROJECT_ROOT
    )
    message = outcome.message or "the capture succeeded: und expert baked for every token"
    refused = not outcome.captured and outcome.cause_type == "RuntimeError"
    _record_refusal(report, target, mode, refused, message, f"{outcome.error_type}/{outcome.cause_type} (fresh process)")


def test_eager_without_mask_still_runs(ar_models, report) -> None:
    """Embeddings without ids in eager: no error, finite logits, und expert everywhere (upstream)."""
    models = ar_models
    ids = models.ids(PROMPTS[2].rows)  # mixed
    with make_runner("eager", device=models.device).prepare(
        lambda e: models.target.forward(None, e), (ids,), taps=moe_taps(models.target)
    ) as run:
        result = run(models.target.embed(ids))
    finite = bool(torch.isfinite(result.output.logits).all())
    report.verdict(
        flag_rule(finite, metric="finite_logits", detail="eager forward on embeddings alone"),
        case="eager-without-mask",
    )
    for use in observe_expert_use(models.target, result.taps, TOL["expert_observation"]):
        on_gen = int(use.used_gen.sum())
        report.info(
            case="eager-without-mask",
            site=f"layer.{use.layer}",
            metric="tokens_on_gen_expert",
            value=on_gen,
            detail="mask None: the upstream hazard routes every token to the und expert",
        )


def test_missing_probe_warning_fires_exactly_once(ar_models, report, settings, target, monkeypatch) -> None:
    """Once per process, pinned with three model instances in one fresh process: 25 forwards of
    the first warn once; forwards of the first and of two more instances (one built after the
    warning) add none. A "once" kept per model instance passes the first count and fails the
    second; one kept per layer or per call fails the first."""
    require_graph_support(ar_models.target, "cpu_graph")
    asked, warns = requirement("is_capturing_every_forward"), requirement("probe_warning_text")
    contract = f"`{asked.words}` {asked.rule}; the registry {warns.rule} ({asked.cite})"
    where = dict(case="missing-probe-warn-once")
    if record_policy_not_applicable(report, target, "probe_warning", metrics=["missing_probe_warnings"], **where):
        return
    _child_env(monkeypatch, settings, "cpu")
    code = "from parity.suites.ar.fail_closed_cases import count_missing_probe_warnings as c; print('WARNINGS', *c(25))"
    done = run_watched([sys.executable, "-c", code], cwd=PROJECT_ROOT)  # stopped only when it stalls (docs/cli.md §9)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("WARNINGS ")]
    if not lines:
        raise RuntimeError(f"probe-warning child exited {done.returncode} without a count: {done.stderr[-2000:]}")
    first, more = (int(v) for v in lines[-1].split()[1:3])
    report.verdict(
        count_rule(
            first,
            1,
            metric="missing_probe_warnings",
            at=EXACTLY,
            detail=f"25 forwards of one model instance on a backend whose probe was removed, fresh process: {contract}",
        ),
        case="missing-probe-warn-once",
    )
    report.verdict(
        count_rule(
            more,
            0,
            metric="missing_probe_warnings",
            at=EXACTLY,
            detail="then 27 forwards alternating between that instance, a second one and a third built after the "
            f"process warned: the warning is once per process, not once per model instance ({warns.cite})",
        ),
        case="missing-probe-warn-once-per-process",
    )


def test_requires_raw_input_tokens(ar_models, report, target) -> None:
    """The attribute on the top-level module and every AR wrapper class the target declares, and
    by behaviour: the multimodal entry gives the logits of an ids forward, not of an embeddings-only one."""
    models = ar_models
    require_graph_support(models.target, "cpu_graph")
    holders = [type(models.target.module), *getattr(models.target, "ar_wrapper_classes", lambda: [])()]
    policy, raw = "raw_input_tokens_attribute", requirement("raw_input_tokens")
    if record_policy_not_applicable(report, target, policy, metrics=["requires_raw_input_tokens"], case="attribute"):
        holders = []
    for holder in holders:
        value = getattr(holder, "requires_raw_input_tokens", False) is True
        report.verdict(
            flag_rule(
                value, metric="requires_raw_input_tokens", detail=f"{holder.__qualname__}: {raw.words} {raw.rule} ({raw.cite})"
            ),
            case=f"attribute-{holder.__name__}",
        )
    ids = models.ids(PROMPTS[2].rows)  # mixed: gen tokens present
    embeds = models.target.embed(ids)
    entry = models.target.forward_multimodal(embeds, ids).logits
    with_ids = models.target.forward(ids).logits
    without_ids = models.target.forward(None, embeds).logits
    report.diff(
        diff(with_ids, entry, TOL["entry_vs_ids_forward"], name="multimodal entry vs ids forward"),
        case="entry-passes-input-ids",
        site="logits",
    )
    apart = float((entry - without_ids).abs().max())
    report.verdict(
        threshold_rule(
            apart,
            1e-3,
            metric="distance_from_ids_dropped",
            at=AT_LEAST,
            detail="the entry's logits must differ from an embeddings-only forward when the prompt holds gen tokens",
        ),
        case="entry-passes-input-ids",
    )


def test_pipeline_factory_seeds_gen_token_mask(ar_models, report, target) -> None:
    """The factory the constructor installed (not a helper called directly) seeds the mask."""
    models = ar_models
    require_graph_support(models.target, "cpu_graph")
    where = dict(case="pp-empty-intermediate-tensors")
    if record_policy_not_applicable(report, target, "pipeline_parallel_factory", metrics=["factory_installed"], **where):
        return
    seeds = requirement("pipeline_factory")
    factory = getattr(models.target.module, "make_empty_intermediate_tensors", None)
    if factory is None:
        report.verdict(
            flag_rule(False, metric="factory_installed", detail=f"the module has no {seeds.words} ({seeds.cite})"),
            case="pp-empty-intermediate-tensors",
        )
        return
    tensors = factory(3, models.dtype, models.device)
    mask = tensors.get("gen_token_mask") if hasattr(tensors, "get") else None
    ok = mask is not None and mask.dtype == torch.bool and mask.shape[0] == 3 and not bool(mask.any())
    detail = "missing" if mask is None else f"{mask.dtype} {tuple(mask.shape)}"
    report.verdict(
        flag_rule(ok, metric="gen_token_mask_seeded", detail=f"gen_token_mask: {detail}; {seeds.rule} ({seeds.cite})"),
        case="pp-empty-intermediate-tensors",
    )
