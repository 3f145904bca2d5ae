"""Conformance of a target to the contract (docs/targets.md), checked once before any suite runs.

`check_target(target, spec)` asks what `parity/target.py`'s Protocols describe, family by family:
the target's own members (`name`, the capture registry, `not_applicable`), which model families it
provides (`load_ar`/`build_ar`, `load_dit`/`build_dit`, `router()`), and for each provided family
a probe that builds the family on a tiny input and checks every adapter member, its return type
and shapes. The probes live with their family's suites (`parity/suites/<family>/conformance.py`,
named here by string so the core imports no model); a family a target leaves out is listed as
skipped with the reason. The result says which suites will run or skip and why.

`parity check-target SPEC` prints it; `parity run` runs it first (in a fresh process: calling a
target factory may patch modules, as the mutant catalogue's do) and stops with one line when a
member is missing or returns the wrong thing. Both run the check in a child process
(`start_check`) under a time limit, so a target that calls `sys.exit` or `os._exit`, hangs, or
leaves non-daemon threads running (a process that runs the suites could never exit) is named in
one line with the step it was at, instead of ending or stalling the command (docs/targets.md §1, §8).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from parity.observe.progress import POLL_S, STALL_ENV, TargetClock, cpu_seconds, descendants, seconds_setting, stall_limit
from parity.target import (
    ENGINE_POLICIES,
    FAMILIES,
    SUITES_WITHOUT_FAMILY,
    CaptureRegistry,
    ContractBreach,
    Family,
    SuitePlan,
    TargetError,
    exit_text,
    missing_members,
    resolve_target,
    suite_plan,
)

# Every report suite a test under parity/suites/ declares (`pytest.mark.suite`): what `--suite` may name.
KNOWN_SUITES = tuple(dict.fromkeys([s for f in FAMILIES.values() for s in f.suites] + list(SUITES_WITHOUT_FAMILY)))


def unknown_suites(suites: Iterable[str]) -> list[str]:
    """The names in `suites` that are no report suite (a typo would otherwise probe nothing and pass)."""
    return [suite for suite in dict.fromkeys(suites) if suite not in KNOWN_SUITES]


class ConformanceError(RuntimeError):
    """A target that does not fulfil the contract; the message is one line per problem."""


@dataclasses.dataclass
class FamilyResult:
    family: Family
    provided: bool
    reason: str = ""  # why it is skipped, when not provided
    checks: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Conformance:
    """What `check_target` found: problems (each one line), families and the suites' plan."""

    spec: str
    name: str
    problems: list[str]
    families: list[FamilyResult]
    policies: dict[str, str]
    plan: list[SuitePlan]  # `parity.target.suite_plan`: what the run selects

    @property
    def ok(self) -> bool:
        return not self.problems and not any(f.problems for f in self.families)

    def all_problems(self) -> list[str]:
        return self.problems + [p for f in self.families for p in f.problems]

    def text(self) -> str:
        lines = [f"target {self.name!r} ({self.spec})"]
        lines += [f"  problem: {p}" for p in self.problems]
        for result in self.families:
            name = result.family.name
            if not result.provided:
                lines.append(f"  {name}: skip: {result.reason}")
                continue
            status = "ok" if not result.problems else "PROBLEMS"
            lines.append(f"  {name}: {status} ({', '.join(result.family.members)})")
            lines += [f"    checked: {c}" for c in result.checks]
            lines += [f"    problem: {p}" for p in result.problems]
        if self.policies:
            lines.append("  engine policies declared not applicable (their checks write not_applicable rows):")
            lines += [f"    {policy}: {reason}" for policy, reason in self.policies.items()]
        lines.append("suites:")
        width = max(len(plan.suite) for plan in self.plan)
        for plan in self.plan:
            lines.append(f"  {plan.suite:<{width}}  {'run ' if plan.ok else 'skip'}  {_plan_text(plan)}")
        return "\n".join(lines)


def _probe(path: str) -> Callable[[Any, str], list[str]]:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _target_problems(target: Any, spec: str) -> tuple[list[str], dict[str, str]]:
    problems = []
    name = getattr(target, "name", None)
    if not isinstance(name, str) or not name:
        problems.append(f"target {spec}: 'name' must be a non-empty str, got {name!r}")
    registry = getattr(target, "capture", None)
    if registry is None:
        problems.append(f"target {spec} lacks Target member: capture (a capture-probe registry)")
    else:
        missing = missing_members(registry, CaptureRegistry)
        if missing:
            problems.append(
                f"target {spec}: capture ({type(registry).__name__}) lacks CaptureRegistry members: {', '.join(missing)}"
            )
    declared = getattr(target, "not_applicable", None) or {}
    policies: dict[str, str] = {}
    if not hasattr(declared, "items"):
        problems.append(f"target {spec}: not_applicable must map engine policy -> reason, got {type(declared).__name__}")
        declared = {}
    for policy, reason in declared.items():
        if policy not in ENGINE_POLICIES:
            problems.append(
                f"target {spec}: not_applicable names unknown engine policy {policy!r}; known: {', '.join(ENGINE_POLICIES)}"
            )
        elif not isinstance(reason, str) or not reason.strip():
            problems.append(f"target {spec}: not_applicable[{policy!r}] needs a reason (a non-empty str)")
        else:
            policies[policy] = reason
    return problems, policies


def _plan_text(plan: SuitePlan) -> str:
    """ "AR (DiT not provided)": the families whose tests of the suite run, then those that do not."""
    ran = ", ".join(FAMILIES[key].name if key in FAMILIES else "needs no model family" for key in plan.runs)
    left = [f"{FAMILIES[key].name} not provided" if key in FAMILIES else reason for key, reason in plan.skipped]
    if ran and left:
        return f"{ran} ({'; '.join(left)})"
    return ran or "; ".join(left)


def families_for(suites: Iterable[str]) -> set[str]:
    """The families whose suites are among `suites` (all of them for an empty selection)."""
    wanted = set(suites)
    return {key for key, family in FAMILIES.items() if not wanted or wanted & set(family.suites)}


def check_target(
    target: Any, spec: str, *, device: str = "cpu", suites: Iterable[str] = (), benchmarks: bool = False
) -> Conformance:
    """Check `target` (what `spec`'s factory returned) against the contract on `device`; with
    `suites`, probe only the families those suites need (the others are listed, not probed). The
    plan is the run's own selection (`parity.target.suite_plan`)."""
    problems, policies = _target_problems(target, spec)
    probed = families_for(suites)
    families = []
    for key, family in FAMILIES.items():
        present = [m for m in family.members if hasattr(target, m)]
        if not present:
            members = " / ".join(family.members)
            families.append(FamilyResult(family, False, f"the target provides no {family.name} ({members} absent)"))
            continue
        result = FamilyResult(family, True)
        if key not in probed:
            result.checks = ["not probed: no selected suite needs it"]
            families.append(result)
            continue
        absent = [m for m in family.members if m not in present]
        if absent:
            result.problems.append(f"target {spec} has {', '.join(present)} but lacks {family.name} member: {', '.join(absent)}")
        else:
            announce(f"the {family.name} probe")
            try:
                result.checks = _probe(family.probe)(target, device)
            except ConformanceError as exc:
                result.problems += str(exc).splitlines()
            except SystemExit as exc:  # target code the probe called ended the process: named, not obeyed
                result.problems.append(
                    f"{family.name} probe of {spec}: the target called {exit_text(exc)}: a target must not end the process"
                )
            except Exception as exc:  # the target raised while being probed: that is its problem, in one line
                text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:500]
                result.problems.append(f"{family.name} probe of {spec} raised {text}")
        families.append(result)
    plan = suite_plan(target, spec, benchmarks=benchmarks)
    return Conformance(spec, str(getattr(target, "name", "?")), problems, families, policies, plan)


# ---------------------------------------------------------------------------------------------
# Helpers the family probes share
# ---------------------------------------------------------------------------------------------


class Checks:
    """Collects what a probe checked and what failed; `done()` returns the checks or raises one
    ConformanceError with a line per problem."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.checked: list[str] = []
        self.problems: list[str] = []

    def require(self, obj: Any, protocol: type, label: str) -> bool:
        missing = missing_members(obj, protocol)
        if missing:
            self.problems.append(f"{label} ({type(obj).__name__}) lacks {protocol.__name__} member: {', '.join(missing)}")
            return False
        return True

    def expect(self, ok: bool, problem: str, checked: str = "") -> bool:
        if ok:
            if checked:
                self.checked.append(checked)
        else:
            self.problems.append(f"{self.what}: {problem}")
        return ok

    def attempt(self, call: str, fn: Callable[[], Any]) -> Any:
        """Call `fn`; a raise (or `sys.exit`) is a problem naming `call` (and the call's result is None)."""
        announce(f"{self.what}: {call}")
        try:
            return fn()
        except SystemExit as exc:
            self.problems.append(f"{self.what}: {call} called {exit_text(exc)}: a target must not end the process")
            return None
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:300]
            self.problems.append(f"{self.what}: {call} raised {text}")
            return None

    def obtain(self, call: str, fn: Callable[[], Any], expected: str) -> Any:
        """`attempt` for a call whose result the suites use as an object (an adapter, an expert set):
        None is a problem naming `call` and `expected`, never a silent pass (a `router()` that
        returns None would fail every routing test, docs/targets.md §7)."""
        problems = len(self.problems)
        value = self.attempt(call, fn)
        if value is None and len(self.problems) == problems:
            self.problems.append(f"{self.what}: {call} returned None (expected {expected})")
        return value

    def done(self) -> list[str]:
        if self.problems:
            raise ConformanceError("\n".join(self.problems))
        return self.checked


def shape_text(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} {list(shape)}" if shape is not None else type(value).__name__


# ---------------------------------------------------------------------------------------------
# The check in a process of its own, under a time limit (docs/targets.md §8)
# ---------------------------------------------------------------------------------------------

TIMEOUT_ENV = "PARITY_CHECK_TARGET_TIMEOUT"
DEFAULT_TIMEOUT_S = 180.0  # the serving target's check takes seconds; a CUDA start-up a few more
THREAD_GRACE_S = 2.0  # how long threads the target started may take to end by themselves (the target's own time)
CONFORMS, DOES_NOT_CONFORM, UNRESOLVED = 0, 1, 3  # `parity check-target`'s exit codes (2: usage)
_CHILD_CODE = "import sys; from parity.conformance import child_main; child_main(sys.argv[1])"
SHIELD = True  # the check's first process stays between the command and the target (`_shield`)

_step_listener: Callable[[str], None] | None = None  # set in the check's child: tells the parent each step


def announce(what: str) -> None:
    """Tell the parent the step the check is about to take (a no-op outside the check's child), so
    a target that hangs or ends the process is named with the call it was in."""
    if _step_listener is not None:
        _step_listener(what)


def check_timeout(given: float | None = None) -> float:
    """Seconds the check may take: `given`, else $PARITY_CHECK_TARGET_TIMEOUT, else 180."""
    return seconds_setting(given, TIMEOUT_ENV, DEFAULT_TIMEOUT_S, "check-target time-out")


@dataclasses.dataclass
class CheckOutcome:
    """What a check in a child process found: `code` 0 (conforms), 1 (does not: a problem, an exit,
    a hang, threads left running) or 3 (the spec does not resolve); `lines` one line per problem
    (or the resolution error); `text` the report `parity check-target` prints, when it finished."""

    code: int
    lines: list[str]
    text: str = ""


def threads_left(before: set[threading.Thread], grace: float = THREAD_GRACE_S) -> list[threading.Thread]:
    """Non-daemon threads started since `before` that are still running after `grace` seconds of
    this process's own time (`TargetClock`: a queue for the CPU is not the threads' slowness): the
    interpreter waits for them at exit, so a run with one never ends."""
    clock = TargetClock(os.getpid())
    left = [t for t in threading.enumerate() if t not in before and not t.daemon and t.is_alive()]
    while any(t.is_alive() for t in left) and clock.read() < grace:
        next(t for t in left if t.is_alive()).join(0.05)
    return [t for t in left if t.is_alive()]


def check_here(spec: str, device: str, suites: Iterable[str]) -> CheckOutcome:
    """Resolve and check `spec` in this process (the child's work), threads left running included."""
    before = set(threading.enumerate())
    try:
        target = resolve_target(spec, on_step=announce)
    except ContractBreach as exc:  # the target's code ended the process, forked it, or gave a member that is no method
        return CheckOutcome(DOES_NOT_CONFORM, [str(exc)])
    except TargetError as exc:
        return CheckOutcome(UNRESOLVED, [str(exc)])
    result = check_target(target, spec, device=device, suites=suites)
    announce("waiting for the threads the target started")
    left = threads_left(before)
    if left:
        names = ", ".join(repr(t.name) for t in left[:4]) + (", ..." if len(left) > 4 else "")
        result.problems.append(
            f"target {spec} left {len(left)} non-daemon thread(s) running after its check ({names}): a process that runs "
            "the suites could never exit; start them with daemon=True or stop them (docs/targets.md §1)"
        )
    return CheckOutcome(CONFORMS if result.ok else DOES_NOT_CONFORM, result.all_problems(), result.text())


def _send(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _exit_with_parent(parent: int) -> None:
    """A daemon thread that ends this process when its parent is gone (killed outright: nobody would
    stop a target that hangs)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parity-check-parent-watch", daemon=True).start()


def _shield(worker: int, fd: int, parent: int) -> NoReturn:
    """The check's first process, while `worker` (its child) runs the check: a target that signals
    its parent (`os.kill(os.getppid(), ...)`) reaches this process, not the command waiting for the
    check, which then names it. Reports how `worker` ended and ends; if the command is gone, ends
    the check's whole process group."""
    try:
        while True:
            if os.getppid() != parent:
                os.killpg(0, signal.SIGKILL)
            pid, status = os.waitpid(worker, os.WNOHANG)
            if pid == worker:
                with contextlib.suppress(OSError):
                    _send(fd, {"ended": status})
                os._exit(0)
            time.sleep(0.05)
    finally:
        os._exit(1)  # never back into the code of the process it was forked from


def _default_signals() -> None:
    """The check's processes take every signal as a fresh process does: a handler the command
    (or a pytest process that runs it) installed does not survive into its fork, so a signal the
    target sends ends the process it reaches."""
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)


def child_main(payload: str, *, forked: bool = False) -> NoReturn:
    """The check's child process: fork the process that runs `check_here` (this one stays its parent,
    `_shield`), send each step and the outcome to the command through the pipe named in `payload`,
    and end without waiting for the target's threads."""
    global _step_listener
    options = json.loads(payload)
    fd = int(options["fd"])
    _default_signals()
    worker = os.fork() if SHIELD else 0  # before any thread starts here, and before torch (a fresh child) or its threads are used
    if worker:
        _shield(worker, fd, int(options["parent"]))
    sys.path[:] = options["path"]  # the target resolves as it would in the parent (a fresh interpreter's path differs)
    try:
        _exit_with_parent(os.getppid())
        if forked and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)  # a thread pool the parent started does not survive a fork
        import torch  # noqa: F401  the harness's own import: its seconds are not the target's (docs/targets.md §8)

        _send(fd, {"ready": True, "pid": os.getpid()})  # the parent's clock for the target starts here
        _step_listener = lambda what: _send(fd, {"step": what})
        outcome = check_here(options["spec"], options["device"], options["suites"])
        _send(fd, {"result": dataclasses.asdict(outcome)})
    except BaseException as exc:  # the check itself broke (or target code escaped it): one line, not silence
        text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:500]
        with contextlib.suppress(OSError):
            _send(fd, {"result": {"code": DOES_NOT_CONFORM, "lines": [f"the check of {options['spec']} raised {text}"]}})
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)


def _can_fork() -> bool:
    """A fork shares this process's imports (no second torch import); only from one thread and
    before CUDA starts (neither survives a fork)."""
    if not hasattr(os, "fork") or threading.active_count() != 1:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def _tree_cpu(pid: int) -> float | None:
    """CPU seconds used by `pid` and every process below it; None where /proc cannot tell."""
    used = [cpu_seconds(p) for p in (pid, *descendants(pid))]
    return None if used[0] is None else sum(u for u in used if u is not None)


class CheckProcess:
    """`check_here` running in a child process (a session of its own: its group is killed when the
    check ends, with whatever the target started); `wait` returns its outcome within a time limit."""

    def __init__(self, spec: str, pid: int, fd: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.spec = spec
        self.pid = pid
        self.fd = fd
        self.popen = popen
        self.status: int | None = None  # the child's wait status once reaped
        self.worker_status: int | None = None  # the status of the process that ran the target, as its parent saw it

    def wait(self, timeout: float, stall: float | None = None) -> CheckOutcome:
        """The child's outcome. `timeout` is the target's time (`TargetClock`: from when the check's
        process is ready, its interpreter started and torch imported, less the time it queued for a
        CPU): a loaded machine's slowness is not charged to the target. Until it is ready the child
        is stopped only when it makes no progress (no CPU time used) for `stall` seconds
        (`stall_limit()`: $PARITY_STALL_S)."""
        stall = stall_limit(stall)
        step, buffer, result, clock = "starting", b"", None, None
        used, last_progress = _tree_cpu(self.pid), time.monotonic()
        looked = last_progress
        try:
            while result is None:
                if clock is None:
                    if time.monotonic() - looked >= POLL_S:  # /proc is walked for the tree: not at every turn
                        looked, now_used = time.monotonic(), _tree_cpu(self.pid)
                        if now_used is not None and used is not None and now_used > used:
                            used, last_progress = now_used, looked
                    if time.monotonic() - last_progress >= stall:
                        return CheckOutcome(
                            DOES_NOT_CONFORM,
                            [
                                f"the check's process for target {self.spec} made no progress for {stall:g} s while starting "
                                f"(a fresh interpreter importing torch; before any target code ran; {STALL_ENV} sets the limit)"
                            ],
                        )
                elif clock.read() >= timeout:
                    return CheckOutcome(
                        DOES_NOT_CONFORM,
                        [
                            f"target {self.spec} did not finish its check within {timeout:g} s: it hung in {step} (docs/targets.md §1)"
                        ],
                    )
                ready, _, _ = select.select([self.fd], [], [], POLL_S / 5)
                if not ready:
                    self._reap(block=False)
                    if self.status is not None and not select.select([self.fd], [], [], 0)[0]:
                        break  # ended, and what it sent is read (a process it started may hold the pipe open)
                    continue
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    break  # the child is gone (or closed our pipe) without an outcome
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    with contextlib.suppress(ValueError, AttributeError):  # only the check writes here
                        message = json.loads(line)
                        if message.get("ready") and clock is None:
                            clock = TargetClock(int(message.get("pid", self.pid)))
                        if "ended" in message:
                            self.worker_status = int(message["ended"])
                        step = message.get("step", step)
                        result = message.get("result", result)
            if result is not None:
                return CheckOutcome(int(result["code"]), list(result["lines"]), str(result.get("text", "")))
            return CheckOutcome(DOES_NOT_CONFORM, [self._ended_line(step)])
        finally:
            self.stop()

    def _ended_line(self, step: str) -> str:
        """Why the check ended without an outcome: the target ended its process, or signalled the
        check's first process, its parent."""
        self._drain()
        if self.worker_status is None and self.status is not None and os.WIFSIGNALED(self.status):
            name = signal.Signals(os.WTERMSIG(self.status)).name
            return (  # no step named: the target runs on for a moment after the signal, and steps it reaches then are no clue
                f"target {self.spec} sent {name} to its parent process (the check's first process) during its check: a target "
                "must not signal processes it did not start (docs/targets.md §1)"
            )
        status = self.worker_status if self.worker_status is not None else self.status
        if status is None:
            how = "its pipe closed"
        elif os.WIFSIGNALED(status):
            how = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            how = f"exit code {os.waitstatus_to_exitcode(status)}"
        return (
            f"target {self.spec} ended the check's process ({how}) in {step}: a target must not end the "
            "process (sys.exit or os._exit in its code, or a crash; docs/targets.md §1)"
        )

    def _drain(self) -> None:
        """Read the first process's last word (how the target's process ended), once it has ended."""
        while self.status is None:
            self._reap(block=False)
            if self.status is None:
                time.sleep(0.02)
        buffer = b""
        while select.select([self.fd], [], [], 0)[0]:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                break
            buffer += chunk
        for line in buffer.split(b"\n"):
            with contextlib.suppress(ValueError, AttributeError):
                message = json.loads(line)
                if "ended" in message:
                    self.worker_status = int(message["ended"])

    def _reap(self, *, block: bool) -> None:
        if self.status is not None:
            return
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            if pid == self.pid:
                self.status = status
                if self.popen is not None:
                    self.popen.returncode = os.waitstatus_to_exitcode(status)

    def stop(self) -> None:
        """End the child's process group (the target's own children with it) and reap the child."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self._reap(block=True)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


def start_check(
    spec: str, device: str = "cpu", suites: Iterable[str] = (), *, fresh: bool = False, quiet: bool = False
) -> CheckProcess:
    """Start checking `spec` in a child process: forked from this one where that is safe
    (`_can_fork`), else (or with `fresh`: `parity run`, whose target factory must not patch modules
    in its own process before pytest imports them) a fresh interpreter. `quiet`: the target's own
    output is dropped."""
    read_fd, write_fd = os.pipe()
    payload = {"spec": spec, "device": device, "suites": list(suites), "fd": write_fd, "parent": os.getpid(), "path": sys.path}
    if fresh or not _can_fork():
        sink = subprocess.DEVNULL if quiet else None
        popen = subprocess.Popen(
            [sys.executable, "-c", _CHILD_CODE, json.dumps(payload)],
            pass_fds=(write_fd,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
        )
        os.close(write_fd)
        return CheckProcess(spec, popen.pid, read_fd, popen)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child would write this process's buffered output a second time
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its outcome travels through the pipe
        try:
            os.close(read_fd)
            os.setsid()
            if quiet:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
        finally:
            child_main(json.dumps(payload), forked=True)
    os.close(write_fd)
    return CheckProcess(spec, pid, read_fd)
