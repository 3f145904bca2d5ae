"""Case tables: `cases/*.toml` loaded into typed records, with one clear line when a file is wrong.

A suite declares the shape of its tables as dataclasses; this module checks every key and value
against the dataclass annotations (unknown key, missing field, wrong type, bad value) and names the
file, the table, the case and the key in the error, with what was expected and what was found.
Adding a case is adding a table row, not code.

Values are range-checked too: every float must be finite (a NaN tolerance would pass every
comparison, `err > nan` being false) unless its annotation says `AnyFloat`, and a field annotated
`Annotated[int, Range(lo, hi)]` (or a list or string with a `Range` on its length) must lie in
the range, so a typo'd step count or a huge sequence length is refused here, never left to hang a
run. Record types declared outside the suites get their ranges from `FIELD_RANGES` (a tolerance's
`atol` / `rtol` at most 1, with the reason in the error). A case is also checked as a whole: the
sizes it gives multiply to the elements it asks for (`case_elements`), at most
`MAX_CASE_ELEMENTS`, so values that are each in range cannot ask for terabytes together. Case
names become directory names (images of a case), so they must be plain names (`SAFE_NAME`); they
are unique within a table.

Extra case directories (`--parity-cases DIR`, `add_case_dirs`) add the cases of their
`<family>.toml` to the built-in tables, also to tables loaded before the directories were known
(the suites' conftest imports the AR and DiT tables before pytest configures the session): the
tables handed out are extended in place. A `*.toml` there that is no family's case file is an
error naming it.

In a pytest session with the parity plugin, a case file that cannot be read while the test
modules are collected does not stop the collection (`defer_errors`): its tables come back as
`Unavailable` (empty wherever a module iterates them) and the plugin refuses the session, with the
file's one line and exit status 4, only when a selected test reads that file
(`unreadable_case_files`); a broken `ar.toml` does not block `--parity-suite selfcheck`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
import types
import typing
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from parity.target import FAMILIES

# The built-in cases: `parity/builtin_cases/` (in the repository a link to the top-level `cases/`,
# in the wheel a copy), so an installed parity finds them wherever it runs.
BUILTIN_CASES = Path(__file__).resolve().parent / "builtin_cases"
CASES_DIR_ENV = "PARITY_CASES_DIR"

SUITES_DIR = Path(__file__).resolve().parent / "suites"

_extra_dirs: tuple[Path, ...] = ()


class CaseFileError(ValueError):
    """A malformed case file; the message is one line naming file, table, key, expected, found."""


# A case name (and a run id) becomes a path component: a letter or digit first, then letters,
# digits, '.', '_', '-' (no '/', no '..' component, no hidden names), at most 128 characters.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SAFE_NAME_TEXT = "a plain name (a letter or digit, then letters, digits, '.', '_' or '-'; at most 128 characters)"


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds (inclusive) of a case value, in an `Annotated[...]` field: numbers are checked
    themselves, lists and strings by their length. `finite=False` lets a float be NaN or +-inf
    (routing logits do that on purpose)."""

    low: float | None = None
    high: float | None = None
    finite: bool = True
    reason: str = ""  # said in the error: why the bound is where it is

    def text(self, of_length: bool) -> str:
        what = "of length " if of_length else ""
        why = f" ({self.reason})" if self.reason else ""
        if self.low is not None and self.high is not None:
            return f"{what}in [{_num(self.low)}, {_num(self.high)}]{why}"
        if self.low is not None:
            return f"{what}>= {_num(self.low)}{why}"
        if self.high is not None:
            return f"{what}<= {_num(self.high)}{why}"
        return "any value"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# Shared annotations of case fields. The upper bounds are sanity limits for case files, far above
# any case (the largest built-in: 64 decode steps, 2048 routing rows): a value past them is a typo
# that would run for hours or exhaust memory. Family limits (latent sizes, prompt lengths) are
# declared beside their tables.
MAX_SEED = 2**32 - 1  # numpy's seed range; torch's is wider
MAX_STEPS = 4096
MAX_ROWS = 1 << 20
Seed = Annotated[int, Range(0, MAX_SEED)]
Steps = Annotated[int, Range(1, MAX_STEPS)]
Count = Annotated[int, Range(0, MAX_ROWS)]  # rows, tokens, lengths: zero allowed
Positive = Annotated[int, Range(1, MAX_ROWS)]
NonNegative = Annotated[float, Range(0, None)]
AnyFloat = Annotated[float, Range(finite=False)]

# Ranges of record types a case file uses but the suites do not declare (they are built in code
# too): qualified class name -> field -> Range. A tolerance of 1 or more on the values parity
# compares (logits, hidden states, velocities: order one; routing weights: in [0, 1]) accepts any
# answer: `atol = 1e308` is a check switched off, never a tolerance (docs/tolerances.md says how
# bounds are set). Non-negativity stays `Tolerance`'s own check.
TOLERANCE_LIMIT = Range(
    None, 1.0, reason="a tolerance of 1 or more accepts any answer on values of order one: logits, states, routing weights"
)
FIELD_RANGES: dict[str, dict[str, Range]] = {
    "parity.compare.verdict.Tolerance": {"atol": TOLERANCE_LIMIT, "rtol": TOLERANCE_LIMIT},
}

# What one case may ask for as a whole: its sizes multiplied (`case_elements`). 2^32 elements are
# 16 GiB in fp32, 44 times the largest built-in case (a DiT sampler case: 128x128 latents x 77 text
# tokens x 77 negative ones = 9.7e7; the serving-scale routing grid: 8.4e6); past it a case that is
# in range value by value (routing rows and experts each up to 2^20: 4 TiB of logits together)
# would allocate terabytes or run for days.
MAX_CASE_ELEMENTS = 1 << 32
_NOT_SIZES = (Range(0, MAX_SEED), Range(1, MAX_STEPS))  # seeds and step counts say nothing of memory


def check_safe_name(name: str, what: str) -> str:
    """`name` if it is a safe path component (`SAFE_NAME`), else a ValueError naming `what`."""
    if not SAFE_NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r}: expected {SAFE_NAME_TEXT}")
    return name


def cases_dir() -> Path:
    """Where the built-in case files live: `$PARITY_CASES_DIR` (a replacement set), else the
    package's `builtin_cases/`."""
    return Path(os.environ.get(CASES_DIR_ENV) or BUILTIN_CASES)


def case_path(name: str) -> Path:
    path = Path(name)
    return path if path.is_absolute() else cases_dir() / path


# ---------------------------------------------------------------------------------------------
# Type checking against annotations
# ---------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extras = typing.get_args(tp)
        ranges = [e for e in extras if isinstance(e, Range)]
        of_length = typing.get_origin(base) in (list, tuple) or base is str
        return _type_name(base) + "".join(f" {r.text(of_length)}" for r in ranges if r.low is not None or r.high is not None)
    if tp is type(None):
        return "none"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"table of {_type_name(k)} -> {_type_name(v)}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"table ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _found(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kinds: dict[type, str] = {dict: "table", list: "array"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"{kind} {text}"


class _Mismatch(Exception):
    def __init__(self, where: str, expected: str, found: str):
        super().__init__(where)
        self.where, self.expected, self.found = where, expected, found


def _convert(value: Any, tp: Any, where: str, *, finite: bool = True) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Annotated:
        base, *extras = typing.get_args(tp)
        ranges = [e for e in extras if isinstance(e, Range)]
        # A value of the wrong type says the type it needed; one of the right type out of range says the range.
        converted = _convert(value, base, where, finite=all(r.finite for r in ranges))
        for bound in ranges:
            _check_range(converted, bound, tp, where)
        return converted
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            if option is type(None):
                continue
            try:
                return _convert(value, option, where, finite=finite)
            except _Mismatch:
                continue
        raise _Mismatch(where, _type_name(tp), _found(value))
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise _Mismatch(where, _type_name(tp), _found(value))
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _Mismatch(where, _type_name(tp), _found(value))
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _Mismatch(where, f"{_type_name(tp)} of length {len(args)}", _found(value))
            return tuple(_convert(v, a, f"{where}[{i}]", finite=finite) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_convert(v, item, f"{where}[{i}]", finite=finite) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Mismatch(where, _type_name(tp), _found(value))
        return {_convert(k, key_tp, where): _convert(v, value_tp, f"{where}.{k}", finite=finite) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch(where, _type_name(tp), _found(value))
        return _build(tp, value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch(where, "float", _found(value))
        if finite and not math.isfinite(value):
            raise _Mismatch(where, "a finite float", _found(value))
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(where, "int", _found(value))
        return value
    if tp in (str, bool):
        if type(value) is not tp:
            raise _Mismatch(where, tp.__name__, _found(value))
        return value
    raise TypeError(f"case schema uses an unsupported annotation {tp!r} at {where}")


def _check_range(value: Any, bound: Range, tp: Any, where: str) -> None:
    of_length = isinstance(value, (list, tuple, str))
    measured = len(value) if of_length else value
    if isinstance(measured, (int, float)) and (math.isnan(measured) and not bound.finite):
        return  # a NaN where NaN is allowed has no place in a range
    low_ok = bound.low is None or measured >= bound.low
    high_ok = bound.high is None or measured <= bound.high
    if not (low_ok and high_ok):
        found = f"length {measured}" if of_length else _found(value)
        raise _Mismatch(where, _type_name(tp), found)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _hints(cls: type) -> dict[str, Any]:
    """The field annotations of `cls`, with the ranges `FIELD_RANGES` adds to a record type the
    suites do not declare."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for name, bound in FIELD_RANGES.get(f"{cls.__module__}.{cls.__qualname__}", {}).items():
        hints[name] = Annotated[hints[name], bound]
    return hints


def _build(cls: type[Any], data: Mapping[str, Any], where: str = "") -> Any:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise _Mismatch(_join(where, unknown[0]), f"one of the keys {', '.join(fields)}", f"unknown key {unknown[0]!r}")
    kwargs = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise _Mismatch(_join(where, name), _type_name(hints[name]), "nothing (missing field)")
            continue
        kwargs[name] = _convert(data[name], hints[name], _join(where, name))
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise _Mismatch(where, f"a valid {cls.__name__}", f"{exc}") from exc


# ---------------------------------------------------------------------------------------------
# A case as a whole: the elements its sizes ask for
# ---------------------------------------------------------------------------------------------


def _is_size(ranges: list[Range]) -> bool:
    """An int with a bounded non-negative range is a size (rows, tokens, pixels, experts), except a
    seed or a step count."""
    return any(r.low is not None and r.low >= 0 and r.high is not None and r not in _NOT_SIZES for r in ranges)


def _size(value: Any, tp: Any, name: str) -> tuple[int, list[str]]:
    """(elements, the factors that make them) of one field value: an int size is itself, a tuple the
    product of its items (a shape), a list the largest of its items (the points of a sweep), times
    its length when the list has a bounded length (a batch)."""
    ranges: list[Range] = []
    while typing.get_origin(tp) is Annotated:
        tp, *extras = typing.get_args(tp)
        ranges += [e for e in extras if isinstance(e, Range)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return max((_size(value, a, name) for a in options), key=lambda found: found[0], default=(1, []))
    if isinstance(value, bool) or value is None:
        return 1, []
    if isinstance(value, int):
        return (value, [f"{name} {value}"]) if _is_size(ranges) and value > 1 else (1, [])
    if isinstance(value, (list, tuple)):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if typing.get_origin(tp) is tuple and len(args) == len(value) and len(args) > 1:
            total, parts = 1, list[str]()
            for i, (item, item_tp) in enumerate(zip(value, args)):
                n, p = _size(item, item_tp, f"{name}[{i}]")
                total, parts = total * n, parts + p
            return total, parts
        item_tp = args[0] if args else Any
        total, parts = max((_size(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)), key=lambda f: f[0], default=(1, []))
        if any(r.high is not None for r in ranges) and len(value) > 1:
            total, parts = total * len(value), [f"{name} x{len(value)}", *parts]
        return total, parts
    return 1, []


def case_elements(record: Any) -> tuple[int, list[str]]:
    """(elements, factors) a case asks for as a whole: its own `case_elements()` when its type has
    one, else the product of its sizes (`_size`: the largest point of a sweep over several lists,
    a batch times its largest item), or the largest record it holds, whichever is more. An
    over-estimate by design: a bound on memory and time, not an allocation plan."""
    own = getattr(record, "case_elements", None)
    if callable(own):
        return int(own()), [f"{type(record).__name__}.case_elements()"]
    hints = _hints(type(record))
    total, parts = 1, list[str]()
    nested: tuple[int, list[str]] = (1, [])  # records inside a record are cases of their own (warm-up points)
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        if items and all(dataclasses.is_dataclass(v) and not isinstance(v, type) for v in items):
            nested = max([nested, *(case_elements(v) for v in items)], key=lambda found: found[0])
            continue
        n, p = _size(value, hints.get(field.name, Any), field.name)
        total, parts = total * n, parts + p
    return max((total, parts), nested, key=lambda found: found[0])


def _check_elements(record: Any) -> None:
    total, parts = case_elements(record)
    if total > MAX_CASE_ELEMENTS:
        raise _Mismatch(
            "",
            f"a case of at most {MAX_CASE_ELEMENTS} elements (2^32, 16 GiB of fp32; each value is in range, the case as a whole is not)",
            f"{' x '.join(parts)} = {total:.3g} elements",
        )


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Table:
    """How one top-level table of a case file is shaped.

    `many=True`: an array of tables (`[[name]]`), each a record with a unique `name` field.
    `many=False`: a single table (`[name]`). `keyed=True`: a table of named sub-tables
    (`[name.key]`), returned as a dict.
    """

    record: type
    many: bool = True
    keyed: bool = False
    required: bool = True


class CaseTables(dict):
    """The tables of one case file (table name -> records), as `load_case_file` hands them out.

    A built-in file's tables remember the file's own records, so `add_case_dirs` can extend them in
    place (and take a directory's cases out again): a module that bound a table at import sees the
    extra cases its test modules are parametrized over."""

    path: Path
    schema: Mapping[str, Table]
    builtin: dict[str, Any]


_loaded: list[weakref.ref[CaseTables]] = []  # built-in tables handed out, extended by add_case_dirs


def load_case_file(path: str | Path, schema: Mapping[str, Table]) -> dict[str, Any] | Unavailable:
    """Load and validate one case file against `schema` (top-level table name -> `Table`), then add
    the cases of the file of the same name in each extra case directory (`add_case_dirs`).

    While a pytest session collects its tests (`defer_errors`), a file that cannot be read gives
    `Unavailable` instead of raising; the plugin refuses the session if a selected test reads it."""
    path = case_path(str(path))
    try:
        loaded = _load_one(path, schema, partial=False)
        if path.parent.resolve() != cases_dir().resolve():
            return loaded
        tables = CaseTables(_copy_tables(loaded))
        tables.path, tables.schema, tables.builtin = path, schema, loaded
        if "*" in _extra_errors:
            raise CaseFileError(_extra_errors["*"])
        _apply_extras(tables)
    except CaseFileError as exc:
        if not deferring():
            raise
        return unavailable(path.name, exc)
    _loaded.append(weakref.ref(tables))
    return tables


def _copy_tables(tables: Mapping[str, Any]) -> dict[str, Any]:
    return {name: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v for name, v in tables.items()}


def _reset(tables: CaseTables) -> None:
    """`tables` back to the built-in file's records, in place (the lists and dicts modules bound stay)."""
    for name, records in tables.builtin.items():
        if isinstance(records, list):
            tables[name][:] = records
        elif isinstance(records, dict):
            tables[name].clear()
            tables[name].update(records)
        else:
            tables[name] = records


def _apply_extras(tables: CaseTables) -> None:
    """Reset `tables` in place to the built-in file's records, then add each extra directory's file
    of the same name."""
    _reset(tables)
    for directory in _extra_dirs:
        extra = directory / tables.path.name
        if extra.is_file():
            _extend(tables, _load_one(extra, tables.schema, partial=True), tables.schema, _label(tables.path), _label(extra))


def add_case_dirs(directories: Iterable[str | Path]) -> None:
    """Directories whose case files extend the built-in ones (`--parity-cases DIR`): a user's
    `ar.toml` there adds its cases to the built-in `ar.toml`, also to tables loaded already (in
    place). Set once per session. Never raises: a file that cannot be added, or a `*.toml` that is
    no family's, is remembered for `unreadable_case_files` (and raised by the next
    `load_case_file` of that file outside a collecting session)."""
    global _extra_dirs
    _extra_dirs = tuple(Path(d) for d in directories)
    _extra_errors.clear()
    known = sorted(p.name for p in cases_dir().glob("*.toml"))
    for directory in _extra_dirs:
        for unknown in sorted(p.name for p in directory.glob("*.toml") if p.name not in known):
            close = difflib.get_close_matches(unknown, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            _extra_errors.setdefault(
                "*",
                f"--parity-cases {directory}: {unknown}: not a case file parity reads{hint}; the case files are {', '.join(known)}",
            )
    for ref in list(_loaded):
        tables = ref()
        if tables is None:
            _loaded.remove(ref)
            continue
        try:
            _apply_extras(tables)
        except CaseFileError as exc:
            _reset(tables)
            _extra_errors.setdefault(tables.path.name, str(exc))


def _extend(loaded: dict[str, Any], extra: dict[str, Any], schema: Mapping[str, Table], base: str, label: str) -> None:
    """Add `extra`'s cases to `loaded`, in place: arrays are extended, keyed tables updated; a case
    name, key or single table that both files define is an error naming both files."""
    for name, table in schema.items():
        if name not in extra:
            continue
        if table.keyed:
            clash = sorted(set(loaded[name]) & set(extra[name]))
            if clash:
                raise CaseFileError(f"{label}: table [{name}.{clash[0]}]: already defined in {base}")
            loaded[name].update(extra[name])
        elif table.many:
            names = {getattr(record, "name", None) for record in loaded[name]}
            for record in extra[name]:
                # a table of unnamed records (quick.toml's) adds them: its own loader checks them
                if getattr(record, "name", None) is not None and record.name in names:
                    raise CaseFileError(f"{label}: table [{name}] case {record.name!r}: a case of that name is already in {base}")
            loaded[name].extend(extra[name])
        else:
            raise CaseFileError(
                f"{label}: table [{name}]: a single table, already set in {base} (extra case files add cases, they do not replace settings)"
            )


# ---------------------------------------------------------------------------------------------
# A case file that cannot be read, in a session that may not need it
# ---------------------------------------------------------------------------------------------

_defer = False
_import_errors: dict[str, str] = {}  # case file name -> its one line, for files that could not be loaded
_extra_errors: dict[str, str] = {}  # the same for the extra directories of this session ("*": every file)
# Which case files the tests of a suite directory read; a directory not listed reads them all
# (the sensitivity suite runs every family's tests, the benchmarks build every family).
SUITE_CASE_FILES = {
    **{key: family.case_file for key, family in FAMILIES.items() if family.case_file},
    "selfcheck": "selfcheck.toml",
}


def defer_errors(enabled: bool = True) -> None:
    """Collect test modules past a case file that cannot be read: the plugin switches this on as it
    declares its options (before the suites' conftest imports the first tables) and off when the
    collection is over, so a load inside a test raises as ever. (Not `PYTEST_CURRENT_TEST`: a
    session started from inside a test inherits that variable.)"""
    global _defer
    _defer = enabled


def deferring() -> bool:
    return _defer


class Unavailable:
    """The tables of a case file that could not be read, while a session collects its tests:
    empty wherever a module iterates them (its parametrized tests get no case), every item or
    attribute another `Unavailable`, so the module imports; the session is refused before any test
    if a selected test reads the file (`unreadable_case_files`)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error

    def __getitem__(self, key: Any) -> Unavailable:
        return self

    def __getattr__(self, name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Unavailable:
        return self

    def __iter__(self) -> typing.Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, item: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<case tables unavailable: {self.error}>"


def unavailable(file_name: str, error: Exception | str) -> Unavailable:
    """Remember that `file_name` could not be read (its one line) and stand in for its tables."""
    _import_errors.setdefault(file_name, str(error))
    return Unavailable(str(error))


def unreadable_case_files(test_paths: Iterable[str | Path]) -> str | None:
    """The one line of a case file that could not be read and that one of the tests at `test_paths`
    (the selected ones) reads, or None. A test outside `parity/suites` reads none."""
    errors = {**_import_errors, **_extra_errors}
    if not errors:
        return None
    needed: set[str] = set()
    for test_path in test_paths:
        try:
            family = Path(test_path).resolve().relative_to(SUITES_DIR).parts[0]
        except (ValueError, IndexError):
            continue
        own = SUITE_CASE_FILES.get(family)
        needed |= set(errors) if own is None else {own, "*"}
    for name in sorted(errors):
        if name in needed:
            return errors[name]
    return None


def _load_one(path: Path, schema: Mapping[str, Table], *, partial: bool) -> dict[str, Any]:
    label = _label(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CaseFileError(f"{label}: case file not found") from None
    except OSError as exc:
        raise CaseFileError(f"{label}: cannot read the case file ({exc.strerror or type(exc).__name__})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise CaseFileError(
            f"{label}: not UTF-8 text (line {line}: byte {data[exc.start : exc.start + 1]!r}); TOML files are UTF-8"
        ) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CaseFileError(f"{label}: invalid TOML: {exc}") from None
    unknown = [k for k in raw if k not in schema]
    if unknown:
        raise CaseFileError(
            f"{label}: table [{unknown[0]}]: unknown table; expected one of {', '.join(f'[{k}]' for k in schema)}"
        )
    loaded: dict[str, Any] = {}
    for name, table in schema.items():
        if name not in raw:
            if partial:
                continue
            if table.required:
                raise CaseFileError(f"{label}: table [{name}]: missing (expected {_shape(table)})")
            loaded[name] = [] if table.many and not table.keyed else {}
            continue
        loaded[name] = _load_table(label, name, raw[name], table)
    return loaded


def _shape(table: Table) -> str:
    if table.keyed:
        return f"[{{name}}.<key>] tables of {table.record.__name__}"
    return f"[[...]] array of {table.record.__name__}" if table.many else f"a table {table.record.__name__}"


def _load_table(label: str, name: str, value: Any, table: Table) -> Any:
    where = f"[{name}]"
    try:
        if table.keyed:
            _need(value, dict, _shape(table))
            by_key: dict[str, Any] = {}
            for key, item in value.items():
                where = f"[{name}.{key}]"
                by_key[key] = _build(table.record, _need(item, dict, "a table"))
                _check_elements(by_key[key])
            return by_key
        if table.many:
            _need(value, list, _shape(table))
            records: list[Any] = []
            seen: set[str] = set()
            for i, item in enumerate(value):
                case = item.get("name", f"#{i}") if isinstance(item, dict) else f"#{i}"
                where = f"[{name}] case {case!r}"
                record = _build(table.record, _need(item, dict, "a table"))
                if isinstance(getattr(record, "name", None), str) and not SAFE_NAME.fullmatch(record.name):
                    raise _Mismatch("name", SAFE_NAME_TEXT, _found(record.name))
                if case in seen:
                    raise _Mismatch("name", "a unique case name", f"a duplicate {case!r}")
                seen.add(case)
                _check_elements(record)
                records.append(record)
            return records
        record = _build(table.record, _need(value, dict, _shape(table)))
        _check_elements(record)
        return record
    except _Mismatch as exc:
        key_text = f" key {exc.where!r}:" if exc.where else ""
        raise CaseFileError(f"{label}: table {where}:{key_text} expected {exc.expected}, found {exc.found}") from None


def _need(value: Any, kind: type, expected: str) -> Any:
    if not isinstance(value, kind):
        raise _Mismatch("", expected, _found(value))
    return value


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
