"""Case tables: `cases/*.toml` loaded into typed records, with one clear line when a file is wrong.

A suite declares the shape of its tables as dataclasses; this module checks every key and value
against the dataclass annotations (unknown key, missing field, wrong type, bad value) and names the
file, the table, the case and the key in the error, with what was expected and what was found.
Adding a case is adding a table row, not code.

Values are range-checked too: every float must be finite (a NaN tolerance would pass every
comparison, `err > nan` being false) unless its annotation says `AnyFloat`, and a field annotated
`Annotated[int, Range(lo, hi)]` (or a list or string with a `Range` on its length) must lie in
the range, so a typo'd step count or a huge sequence length is refused here, never left to hang a
run. Case names become directory names (images of a case), so they must be plain names
(`SAFE_NAME`); they are unique within a table.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

T = TypeVar("T")

# The built-in cases: `parity/builtin_cases/` (in the repository a link to the top-level `cases/`,
# in the wheel a copy), so an installed parity finds them wherever it runs.
BUILTIN_CASES = Path(__file__).resolve().parent / "builtin_cases"
CASES_DIR_ENV = "PARITY_CASES_DIR"

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

    def text(self, of_length: bool) -> str:
        what = "of length " if of_length else ""
        if self.low is not None and self.high is not None:
            return f"{what}in [{_num(self.low)}, {_num(self.high)}]"
        if self.low is not None:
            return f"{what}>= {_num(self.low)}"
        if self.high is not None:
            return f"{what}<= {_num(self.high)}"
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


def check_safe_name(name: str, what: str) -> str:
    """`name` if it is a safe path component (`SAFE_NAME`), else a ValueError naming `what`."""
    if not SAFE_NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r}: expected {SAFE_NAME_TEXT}")
    return name


def cases_dir() -> Path:
    """Where the built-in case files live: `$PARITY_CASES_DIR` (a replacement set), else the
    package's `builtin_cases/`."""
    return Path(os.environ.get(CASES_DIR_ENV) or BUILTIN_CASES)


def add_case_dirs(directories: Iterable[str | Path]) -> None:
    """Directories whose case files extend the built-in ones (`--parity-cases DIR`): a user's
    `ar.toml` there adds its cases to the built-in `ar.toml`. Set once per session."""
    global _extra_dirs
    _extra_dirs = tuple(Path(d) for d in directories)


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
    if dataclasses.is_dataclass(tp):
        return f"table ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _found(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = {dict: "table", list: "array"}.get(type(value), type(value).__name__)
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
    if dataclasses.is_dataclass(tp):
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


def _build(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    hints = typing.get_type_hints(cls, include_extras=True)
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


def load_case_file(path: str | Path, schema: Mapping[str, Table]) -> dict[str, Any]:
    """Load and validate one case file against `schema` (top-level table name -> `Table`), then add
    the cases of the file of the same name in each extra case directory (`add_case_dirs`)."""
    path = case_path(str(path))
    loaded = _load_one(path, schema, partial=False)
    if path.parent.resolve() == cases_dir().resolve():  # a built-in file: user directories may extend it
        for directory in _extra_dirs:
            extra = directory / path.name
            if extra.is_file():
                _extend(loaded, _load_one(extra, schema, partial=True), schema, _label(path), _label(extra))
    return loaded


def _extend(loaded: dict[str, Any], extra: dict[str, Any], schema: Mapping[str, Table], base: str, label: str) -> None:
    """Add `extra`'s cases to `loaded`: arrays are appended, keyed tables merged; a case name, key
    or single table that both files define is an error naming both files."""
    for name, table in schema.items():
        if name not in extra:
            continue
        if table.keyed:
            clash = sorted(set(loaded[name]) & set(extra[name]))
            if clash:
                raise CaseFileError(f"{label}: table [{name}.{clash[0]}]: already defined in {base}")
            loaded[name] = {**loaded[name], **extra[name]}
        elif table.many:
            names = {getattr(record, "name", None) for record in loaded[name]}
            for record in extra[name]:
                if getattr(record, "name", None) in names:
                    raise CaseFileError(f"{label}: table [{name}] case {record.name!r}: a case of that name is already in {base}")
            loaded[name] = [*loaded[name], *extra[name]]
        else:
            raise CaseFileError(
                f"{label}: table [{name}]: a single table, already set in {base} (extra case files add cases, they do not replace settings)"
            )


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
            records = {}
            for key, item in value.items():
                where = f"[{name}.{key}]"
                records[key] = _build(table.record, _need(item, dict, "a table"))
            return records
        if table.many:
            _need(value, list, _shape(table))
            records, seen = [], set()
            for i, item in enumerate(value):
                case = item.get("name", f"#{i}") if isinstance(item, dict) else f"#{i}"
                where = f"[{name}] case {case!r}"
                record = _build(table.record, _need(item, dict, "a table"))
                if isinstance(getattr(record, "name", None), str) and not SAFE_NAME.fullmatch(record.name):
                    raise _Mismatch("name", SAFE_NAME_TEXT, _found(record.name))
                if case in seen:
                    raise _Mismatch("name", "a unique case name", f"a duplicate {case!r}")
                seen.add(case)
                records.append(record)
            return records
        return _build(table.record, _need(value, dict, _shape(table)))
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
