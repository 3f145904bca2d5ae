"""The decode suite's teacher-forced metric goes red on a defect that shows only after step 8,
including when a tie flip earlier ends the free-running comparison, and stays green on a correct
target (tiny model, CPU, in process; one run of the suite file in a pytest session of its own at the end).

A defect visible only late in decode: `tests.support.decode_targets.position_saturated_from`, the decode
position saturating from prompt length + 9 on (steps 0-9 exact, every step from 10 on wrong).

A tie flip on demand: in fp32 the reference's top-2 margins are far above 2 spacings, so a real
flip cannot be waited for. At step 3 the reference's top-2 logits are made an exact tie (its
greedy takes the lower id, torch.argmax returning the first maximum) and the target's the same
tie with the higher id one fp32 spacing ahead: the tokens differ while the reference's margin is
0, which is what a bf16 flip on the H200 looks like (margins 0-0.0625 at steps 2-8).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from parity.compare import FAIL, PASS, TIE_FLIP
from parity.plugin.report_fixture import SuiteReport
from parity.report import ReportWriter, read_results
from parity.suites.ar.decode import (
    SETTINGS,
    FreeRunning,
    ReferenceDecode,
    TeacherForced,
    graph_step,
    judge_free_running,
    judge_teacher_forced,
    reference_decode,
    teacher_forced_step_logits,
    tie_verdict,
    write_teacher_forced,
)
from parity.suites.ar.support import CASES, ARModels, build_ar_models
from serving_models.target import make_target
from tests.support.decode_targets import FIRST_BAD_POSITION, position_saturated_from
from tests.support.helpers import run_isolated_session

PROMPT = [[3, 17, 42, 99, 5]]  # the und-prompt-crosses-into-gen case of cases/ar.toml
STEPS = 64
LATE = 9  # the defect starts at decode position prompt length + 9: step 10 is the first wrong
TIE_STEP = 3


def _models(dtype: torch.dtype, tmp_path_factory: pytest.TempPathFactory) -> ARModels:
    settings = SimpleNamespace(device="cpu", size="tiny", torch_dtype=dtype, seed=0)
    return build_ar_models(settings, make_target(), tmp_path_factory)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory: pytest.TempPathFactory) -> ARModels:
    return _models(torch.float32, tmp_path_factory)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> ARModels:
    return _models(torch.bfloat16, tmp_path_factory)


@pytest.fixture(scope="module")
def late_fp32(fp32: ARModels) -> Callable[[str], TeacherForced]:
    """The fp32 teacher-forced result on the late defect, per mode, made once: the red-buckets test
    and the rows test judge the same eager run."""
    results: dict[str, TeacherForced] = {}

    def forced(mode: str) -> TeacherForced:
        if mode not in results:
            prompt = fp32.ids(PROMPT)
            with late_defect(fp32, prompt.shape[1] + LATE):
                results[mode] = run_both(fp32, prompt, mode)[2]
        return results[mode]

    return forced


@contextlib.contextmanager
def instance_attr(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Shadow a method on one instance for the block (the class and other instances untouched);
    nests: an instance attribute set by an outer block is put back."""
    missing = object()
    previous = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if previous is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)


@contextlib.contextmanager
def late_defect(models: ARModels, first_bad_position: int) -> Iterator[None]:
    with instance_attr(models.target, "decode_step", position_saturated_from(models.target, first_bad_position)):
        yield


def tie_top_two(logits: torch.Tensor, *, higher_id_ahead: bool) -> torch.Tensor:
    """Each row's top-2 logits set to the top-1 value (an exact tie); with `higher_id_ahead` the
    higher id of the two is then one spacing above it, so argmax takes it."""
    top = logits.topk(2, dim=-1)
    value = top.values[..., :1]
    out = logits.scatter(-1, top.indices, value.expand_as(top.indices))
    if higher_id_ahead:
        higher = top.indices.max(dim=-1, keepdim=True).values
        out = out.scatter(-1, higher, torch.nextafter(value, torch.full_like(value, math.inf)))
    return out


@contextlib.contextmanager
def tie_at_step(models: ARModels, length: int, step: int) -> Iterator[None]:
    """A tie at `step` in both implementations that the reference and the target break differently."""
    module, compute_logits = models.reference.module, models.reference.module.compute_logits

    def reference_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        if hidden.shape[1] == length + step:  # the recompute whose last position chooses token `step`
            logits = torch.cat([logits[:, :-1], tie_top_two(logits[:, -1:], higher_id_ahead=False)], dim=1)
        return logits

    inner = models.target.decode_step

    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = inner(input_ids, positions)  # decoding position length + step - 1 chooses token `step`
        at_step = (positions == length + step - 1)[:, None]
        return torch.where(at_step, tie_top_two(logits, higher_id_ahead=True), logits)

    with instance_attr(module, "compute_logits", reference_logits), instance_attr(models.target, "decode_step", decode_step):
        yield


def run_both(models: ARModels, prompt: torch.Tensor, mode: str = "eager") -> tuple[ReferenceDecode, FreeRunning, TeacherForced]:
    """The suite's two metrics on one prompt, as `parity/suites/ar/test_decode.py` runs them."""
    reference = reference_decode(models, prompt, STEPS)
    batch, length = prompt.shape
    if mode == "eager":
        got = models.target.greedy_generate(prompt, STEPS)
        forced = teacher_forced_step_logits(models.target, prompt, reference.tokens)
    else:
        models.target.allocate_decode_state(batch, length + STEPS)
        run, step = graph_step(models, mode, batch)
        with run:
            got = models.target.greedy_generate(prompt, STEPS, step_fn=step)
        models.target.allocate_decode_state(batch, length + STEPS)
        run, step = graph_step(models, mode, batch)
        with run:
            forced = teacher_forced_step_logits(models.target, prompt, reference.tokens, step_fn=step)
    return (
        reference,
        judge_free_running(models, reference, got.tokens, got.step_logits),
        judge_teacher_forced(models, reference, forced),
    )


def verdicts(result: TeacherForced) -> list[str]:
    return [bucket.verdict.verdict for bucket in result.buckets]


def sites(result: TeacherForced) -> list[str]:
    return [bucket.site for bucket in result.buckets]


def test_bucket_size_comes_from_the_case_file_with_its_reason() -> None:
    assert SETTINGS.bucket_steps == 8 and "8" in SETTINGS.bucket_reason
    assert STEPS % SETTINGS.bucket_steps == 0


# ---------------------------------------------------------------------------------------------
# fp32: the golden noise floor (as in every dtype)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "cpu_graph"])
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_correct_target_is_green_at_every_step(fp32: ARModels, mode: str) -> None:
    _, free, forced = run_both(fp32, fp32.ids(PROMPT), mode)
    assert free.matched.verdict == PASS and free.logits.verdict == PASS
    assert verdicts(forced) == [PASS] * (STEPS // SETTINGS.bucket_steps)
    assert sites(forced)[:2] == ["teacher_forced.steps.0-7", "teacher_forced.steps.8-15"]
    assert sites(forced)[-1] == "teacher_forced.steps.56-63"
    assert (forced.compared.verdict, forced.compared.metric, forced.compared.value, forced.compared.threshold) == (
        PASS,
        "compared_steps",
        STEPS,
        STEPS,
    )


@pytest.mark.parametrize("mode", ["eager", "cpu_graph"])
@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_a_defect_from_step_10_on_turns_the_teacher_forced_buckets_red_from_steps_8_15(
    late_fp32: Callable[[str], TeacherForced], mode: str
) -> None:
    forced = late_fp32(mode)
    assert verdicts(forced) == [PASS] + [FAIL] * (STEPS // SETTINGS.bucket_steps - 1)
    first_red = forced.buckets[1]
    assert first_red.site == "teacher_forced.steps.8-15"
    assert "first step above the noise floor at step 10:" in first_red.verdict.detail
    assert first_red.verdict.value > 100 * forced.buckets[0].verdict.value  # far above the noise of steps 0-7
    assert forced.compared.verdict == PASS and forced.compared.value == STEPS


def test_after_an_early_tie_flip_free_running_is_green_while_teacher_forcing_catches_the_late_defect(fp32: ARModels) -> None:
    prompt = fp32.ids(PROMPT)
    length = prompt.shape[1]
    with tie_at_step(fp32, length, TIE_STEP), late_defect(fp32, length + LATE):
        reference, free, forced = run_both(fp32, prompt)
    # The free-running metric stops at the flip: a tie, not a defect, and the 3 steps before it agree.
    assert (free.matched.verdict, free.matched.value) == (TIE_FLIP, TIE_STEP), free.matched.detail
    assert "top-2 margin 0 " in free.matched.detail
    assert free.matched.ok and free.logits.verdict == PASS and free.measured.shape[1] == TIE_STEP
    # Teacher forcing compares all 64 steps: the flip's step agrees, the defect from step 10 does not.
    assert verdicts(forced)[0] == PASS
    assert verdicts(forced)[1] == FAIL and "first step above the noise floor at step 10:" in forced.buckets[1].verdict.detail
    assert forced.compared.value == STEPS
    # Without the defect the same tie leaves teacher forcing green: the flip alone is not a failure.
    with tie_at_step(fp32, length, TIE_STEP):
        _, free_ok, forced_ok = run_both(fp32, prompt)
    assert free_ok.matched.verdict == TIE_FLIP
    assert set(verdicts(forced_ok)) == {PASS}


def test_compared_steps_fails_when_the_target_yields_fewer_steps(fp32: ARModels) -> None:
    prompt = fp32.ids(PROMPT)
    reference = reference_decode(fp32, prompt, STEPS)
    forced = teacher_forced_step_logits(fp32.target, prompt, reference.tokens)
    short = judge_teacher_forced(fp32, reference, forced[:, :40])
    assert (short.compared.verdict, short.compared.value, short.compared.threshold) == (FAIL, 40, STEPS)
    assert sites(short)[-1] == "teacher_forced.steps.32-39"


def test_teacher_forced_rows(late_fp32: Callable[[str], TeacherForced], tmp_path: Path) -> None:
    """Per bucket a gate row (rmse_vs_golden, in fp32 as in every dtype) and info rows max_abs and
    max_ulp; then compared_steps."""
    forced = late_fp32("eager")
    report = SuiteReport(ReportWriter(tmp_path, {}), "decode", "test", "case")
    write_teacher_forced(report, forced, case="c", mode="eager")
    rows = read_results(tmp_path)
    buckets = STEPS // SETTINGS.bucket_steps
    assert len(rows) == 3 * buckets + 1
    gates = rows[rows["kind"] == "gate"]
    assert list(gates["site"]) == [f"teacher_forced.steps.{8 * i}-{8 * i + 7}" for i in range(buckets)] + ["teacher_forced"]
    assert list(gates["metric"]) == ["rmse_vs_golden"] * buckets + ["compared_steps"]
    assert list(gates["bound"]) == ["measured"] * buckets + ["fixed"]
    assert list(gates["verdict"]) == [PASS] + [FAIL] * (buckets - 1) + [PASS]
    info = rows[rows["kind"] == "info"]
    assert set(info["metric"]) == {"max_abs", "max_ulp"} and len(info) == 2 * buckets
    assert (info["value"] > 0).all()
    compared = gates.iloc[-1]
    assert (compared["value"], compared["threshold"], compared["better"]) == (STEPS, STEPS, "equal")


# ---------------------------------------------------------------------------------------------
# bf16: the fp64-golden noise floor
# ---------------------------------------------------------------------------------------------


@pytest.mark.parity_slow  # a fresh process or an Inductor compile: seconds (the fast loop leaves it out)
def test_bf16_noise_floor_is_green_on_a_correct_target_and_red_on_the_late_defect(bf16: ARModels, tmp_path: Path) -> None:
    prompt = bf16.ids(PROMPT)
    _, _, forced = run_both(bf16, prompt)
    assert set(verdicts(forced)) == {PASS}
    assert {b.verdict.metric for b in forced.buckets} == {"rmse_vs_golden"}
    assert forced.compared.value == STEPS

    with late_defect(bf16, prompt.shape[1] + LATE):
        _, _, broken = run_both(bf16, prompt)
    assert verdicts(broken)[0] == PASS and verdicts(broken)[1] == FAIL
    assert "above noise floor" in broken.buckets[1].verdict.detail

    report = SuiteReport(ReportWriter(tmp_path, {}), "decode", "test", "case")
    write_teacher_forced(report, broken, case="c", mode="eager")
    rows = read_results(tmp_path)
    bucket = rows[rows["site"] == "teacher_forced.steps.8-15"]
    assert dict(zip(bucket["metric"], bucket["kind"])) == {"rmse_vs_golden": "gate", "max_abs": "info", "max_ulp": "info"}


# ---------------------------------------------------------------------------------------------
# The suite itself, in a pytest session of its own, on the late-defect target
# ---------------------------------------------------------------------------------------------


@pytest.mark.parity_slow
def test_the_decode_suite_goes_red_on_a_late_decode_defect(tmp_path: Path) -> None:
    out = tmp_path / "reports"
    args = [
        "parity/suites/ar/test_decode.py",
        "-q",
        "-k",
        "teacher_forced",
        "--parity-report-dir",
        str(out),
        "--parity-run-id",
        "run",
        "--parity-target",
        "tests.support.decode_targets:late_decode_defect",
    ]
    code, output = run_isolated_session(args, tmp_path / "basetemp")
    assert code == 1, output
    rows = read_results(out / "run")
    gates = rows[rows["kind"] == "gate"]
    prompt_length = {case.name: len(case.prompt[0]) for case in CASES["decode"]}
    for (case, mode), group in gates.groupby(["case", "mode"]):
        by_site = dict(zip(group["site"], group["verdict"]))
        assert by_site["teacher_forced.steps.0-7"] == PASS, (case, mode)
        assert by_site["teacher_forced.steps.8-15"] == FAIL, (case, mode)
        first_bad_step = FIRST_BAD_POSITION - prompt_length[case] + 1  # decoding position L+i-1 gives step i
        detail = group[group["site"] == "teacher_forced.steps.8-15"]["detail"].iloc[0]
        assert f"first step above the noise floor at step {first_bad_step}:" in detail, detail
        compared = group[group["metric"] == "compared_steps"]
        assert list(compared["value"]) == [STEPS] and list(compared["verdict"]) == [PASS]
    assert set(gates["mode"]) == {"eager", "cpu_graph"}
    assert set(gates["case"]) == set(prompt_length)


# ---------------------------------------------------------------------------------------------
# The tie rule with noise measured at the flipping step (bf16 at full size: margins of 3 spacings)
# ---------------------------------------------------------------------------------------------


def _flip_at_three_spacings(target_noise: float) -> tuple[torch.Tensor, ...]:
    """One bf16 step over a 4096-token vocabulary: the golden's top two 0.01 apart at |logit| 5, the
    reference picks token 0 by 0.094 (3 bf16 spacings at 5), the target token 1; both carry
    rounding-like noise of 0.05 elsewhere, the target `target_noise`."""
    gen = torch.Generator().manual_seed(0)
    golden = 2 * torch.randn(1, 1, 4096, generator=gen, dtype=torch.float64).clamp(-2, 2)
    golden[..., 0], golden[..., 1] = 5.06, 5.05
    want = (golden + 0.05 * torch.randn(golden.shape, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    got = (golden + target_noise * torch.randn(golden.shape, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    want[..., 0], want[..., 1] = 5.125, 5.03125
    got[..., 0], got[..., 1] = 5.0, 5.0625
    return golden, want, got, torch.tensor([[0]]), torch.tensor([[1]])


def test_a_flip_inside_the_noise_measured_at_that_step_is_a_tie_flip() -> None:
    golden, want, got, want_tokens, got_tokens = _flip_at_three_spacings(0.05)
    verdict, detail = tie_verdict(torch.bfloat16, want, want_tokens, got_tokens, 0, golden, got)
    assert verdict == TIE_FLIP and "measured noise" in detail
    # the spacing rule alone (no golden) calls the same flip a failure: 3 spacings > 2
    assert tie_verdict(torch.bfloat16, want, want_tokens, got_tokens, 0)[0] == FAIL


def test_a_target_above_the_noise_floor_gets_no_noise_allowance_for_its_flip() -> None:
    golden, want, got, want_tokens, got_tokens = _flip_at_three_spacings(0.5)  # ten times the reference's noise
    verdict, detail = tie_verdict(torch.bfloat16, want, want_tokens, got_tokens, 0, golden, got)
    assert verdict == FAIL and "not counted" in detail
