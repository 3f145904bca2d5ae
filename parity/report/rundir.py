"""Run directories: who owns one, and writing inside one without losing data or following a link.

Every file parity writes into a report directory (run.json, index.html, a baseline, the review
figures) is written whole or not at all: a temporary file created next to it with `O_EXCL` (so a
name planted in advance, a symbolic link included, is never opened) and renamed over it
(`atomic_write`). `results.csv`, appended row by row, is opened with `O_NOFOLLOW` under a run
directory opened with `O_NOFOLLOW` (`parity.report.rows.ReportWriter`). A run directory that is a
symbolic link is refused (`refuse_link`): a run directory received as a CI artifact can carry one
pointing anywhere. docs/reports.md §3.

A run directory has an owner (`RunClaim`): the process that claimed it, recorded in
`.parity-owner` (pid, host, time of the claim) when the session starts, and alive for as long as it
holds an exclusive `flock` on that file. The kernel drops the lock when the process ends however it
ends (`kill -9` included), so a dead owner is told from a live one without trusting a process id
that may have been reused. docs/reports.md §2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import fcntl
import gzip
import itertools
import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any

OWNER_FILE = ".parity-owner"  # the claim of a run directory: its owner's record, and the lock it holds


class UnsafePathError(ValueError):
    """A write parity refuses: through a symbolic link, or over a file it must not replace (one line)."""


def _link_target(path: Path) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(path)
    return "?"


def refuse_link(path: Path, what: str) -> None:
    """Raise `UnsafePathError` when `path` itself is a symbolic link (its parents are the user's choice)."""
    if Path(path).is_symlink():
        raise UnsafePathError(
            f"{path}: {what} is a symbolic link (to {_link_target(Path(path))}); parity does not read or write a run "
            "through links: use the directory it points to"
        )


def atomic_write(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` whole or not at all: a new temporary file in the same directory
    (`O_CREAT | O_EXCL | O_NOFOLLOW`: it never opens a name that already exists, a link included),
    flushed to disk and renamed over `path`. A rename replaces a link at `path` rather than writing
    through it. `.gz` paths are compressed."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(partial, flags, 0o666)
        except FileExistsError:
            continue
        break
    else:  # pragma: no cover - 100 collisions of 32 random bits
        raise UnsafePathError(f"{path.parent}: could not create a temporary file next to {path.name}")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    _sync_directory(path.parent)
    return path


def _sync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a lost machine keeps the old file or the new one)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def open_directory(path: Path, what: str = "the run directory") -> int:
    """A file descriptor of directory `path`, refusing a symbolic link (`O_NOFOLLOW`)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and Path(path).is_symlink():
            refuse_link(Path(path), what)
        raise


# ---------------------------------------------------------------------------------------------
# Owners
# ---------------------------------------------------------------------------------------------


def process_alive(pid: Any, host: Any) -> bool | None:
    """Whether process `pid` of `host` still exists (None: another host, cannot tell)."""
    if host != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclasses.dataclass(frozen=True)
class Owner:
    """What `.parity-owner` says about the process that claimed a run directory."""

    pid: Any = None
    host: Any = None
    claimed: Any = None

    def describe(self) -> str:
        if self.pid is None and self.host is None:
            return "its owner's record is not written yet or unreadable"
        return f"process {self.pid} on {self.host}, claimed {self.claimed}"


def read_owner(run_dir: Path) -> Owner | None:
    """The owner record of `run_dir` (None without one; a torn or foreign record reads as unknown)."""
    path = Path(run_dir) / OWNER_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(4096)
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return Owner()
    if not isinstance(record, dict):
        return Owner()
    return Owner(record.get("pid"), record.get("host"), record.get("claimed"))


def owner_alive(run_dir: Path) -> bool | None:
    """Whether a live process holds the claim of `run_dir`: True (its lock is held), False (the
    claim file is there and nobody holds it: the owner ended), None (no claim file)."""
    path = Path(run_dir) / OWNER_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path, "the run's owner file")
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class RunInUse(ValueError):
    """A run directory claimed by a live process."""

    def __init__(self, run_dir: Path, owner: Owner | None):
        self.run_dir, self.owner = run_dir, owner
        who = owner.describe() if owner is not None else "its owner's record is unreadable"
        super().__init__(f"{run_dir} is in use by a live run ({who})")


_HELD: dict[int, RunClaim] = {}  # fd -> claim, the claims this process holds


def _forget_in_child() -> None:
    """A forked child does not own its parent's runs: close its copies of the claim files (the
    parent's locks stay; the child no longer keeps them alive after the parent has gone)."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@dataclasses.dataclass
class RunClaim:
    """This process's claim of a run directory: the open, exclusively locked `.parity-owner`."""

    run_dir: Path
    fd: int
    made: tuple[Path, ...]  # the directories the claim created: the run directory and missing parents, deepest first
    previous: Owner | None = None  # the record an earlier (ended) owner left; None: the claim file is new

    @classmethod
    def take(cls, run_dir: Path) -> RunClaim:
        """Claim `run_dir` (created if missing) for this process, or raise `RunInUse` when a live
        process holds it. Two processes claiming at once: exactly one gets it. The claim is
        recorded (`record`) by the caller once it has decided to keep it; until then the earlier
        owner's record is left as it was."""
        run_dir = Path(run_dir)
        refuse_link(run_dir, "the run directory")
        made = tuple(itertools.takewhile(lambda d: not d.exists(), (run_dir, *run_dir.parents)))
        run_dir.mkdir(parents=True, exist_ok=True)
        directory = open_directory(run_dir)
        try:
            while True:
                fd = os.open(OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=directory)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise RunInUse(run_dir, read_owner(run_dir)) from None
                # The previous holder may have removed the file between our open and our lock: then
                # the lock is on a file no one else will open, and the claim is taken again.
                try:
                    same = os.fstat(fd).st_ino == os.stat(OWNER_FILE, dir_fd=directory, follow_symlinks=False).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
        finally:
            os.close(directory)
        previous = read_owner(run_dir) if os.fstat(fd).st_size else None
        claim = cls(run_dir, fd, made, previous)
        _HELD[fd] = claim
        return claim

    def record(self) -> None:
        """Write the owner record in place (only the holder of the lock writes it)."""
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "claimed": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"),
        }
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    @property
    def held(self) -> bool:
        return self.fd in _HELD

    def release(self, *, keep_record: bool) -> None:
        """Give the claim up. `keep_record`: leave `.parity-owner` as the record of who made the run
        (its lock released: the owner has ended); otherwise remove it, and the directory when the
        claim made it and nothing else is in it, and so the report directories it made above it (a
        session that wrote no row leaves nothing)."""
        if not self.held:
            return
        try:
            if not keep_record:
                with contextlib.suppress(OSError):
                    os.unlink(self.run_dir / OWNER_FILE)
                for directory in self.made:  # deepest first; one that is not empty stops the walk
                    try:
                        directory.rmdir()
                    except OSError:
                        break
        finally:
            _HELD.pop(self.fd, None)
            os.close(self.fd)
