"""A repro's calls as JSON and tensors: what `calls.json` holds, and the only things it may name.

A repro directory travels (attached to a bug, copied to another machine), so reading one must not
run code that came with it. A pickle can run any code when it is loaded; this format cannot: the
structure of each call is JSON, every tensor is a key into a safetensors file, and the Python
objects it rebuilds are of a few kinds, each named by its import path and checked before use:

* a module: an `nn.Module` subclass, made with `cls.__new__` (its `__init__` does not run), its
  plain attributes, children, parameters and buffers set from the JSON and the weights file;
* a dataclass or NamedTuple made from its fields, an `Enum` member, a dtype, a device, a size;
* a function stage's function: a plain Python function of the run's target's package or of the
  built-in model packages, never one of the standard library or of torch.

Standard-library modules are never imported for a repro, so the names in a planted `calls.json`
reach no `os.system`, `subprocess` or `eval` (docs/localise.md §5).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import nn

# Attributes every module has from `nn.Module.__init__`: rebuilt by it, never stored.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
# Packages whose functions a repro never calls (they reach the file system, the network, processes).
_NEVER_CALLED = frozenset({"torch", "numpy", "safetensors", "pip", "setuptools", "pkg_resources", "_pytest", "pytest"})


_PLAIN_TYPES: dict[str, type] = {
    t.__name__: t for t in (bool, int, float, complex, str)
}  # a type handed to a call (`dtype=float`)
T = TypeVar("T")


class EncodeError(ValueError):
    """A value of a call that this format cannot hold (the repro is not written; the row says why)."""


class ReproError(ValueError):
    """A repro directory that cannot be replayed as it is: one line, with what to do."""


def spell(obj: Any) -> str:
    """`package.module:Qualified.name` of a class or function."""
    return f"{obj.__module__}:{obj.__qualname__}"


def encode(value: Any, tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], key: str, tag: str = "$tensor") -> Any:
    """`value` as JSON data; its tensors go into `tensors` under keys from `key` (`tag` "$weight":
    a module attribute's, into `weights`), a module's parameters and buffers into `weights`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().to("cpu").contiguous()
        return {tag: key}
    if isinstance(value, type) and value.__module__ == "numpy" and hasattr(value, "dtype"):  # np.float32 as an argument
        return {"$numpy_type": str(value.__name__)}
    if isinstance(value, type) and _PLAIN_TYPES.get(value.__name__) is value:
        return {"$type": value.__name__}
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):  # a reference's host-side arrays and scalars
        if getattr(value, "ndim", 0) == 0:
            return {"$numpy_scalar": value.item(), "dtype": str(value.dtype)}
        tensors[key] = torch.from_numpy(value.copy())
        return {"$numpy": key, "store": tag}
    if isinstance(value, nn.Module):
        return {"$module": _encode_module(value, weights, f"{key}.", key)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if isinstance(value, enum.Enum):
        return {"$enum": spell(type(value)), "name": value.name}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {
            "$namedtuple": spell(type(value)),
            "fields": [encode(v, tensors, weights, f"{key}.{i}", tag) for i, v in enumerate(value)],
        }
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, tensors, weights, f"{key}.{i}", tag) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, tensors, weights, f"{key}.{i}", tag) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) for k in value):
            raise EncodeError(f"{key}: a dict with keys other than str or int")
        return {"$dict": [[k, encode(v, tensors, weights, f"{key}.{k}", tag)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: encode(getattr(value, f.name), tensors, weights, f"{key}.{f.name}", tag)
            for f in dataclasses.fields(value)
            if f.init
        }
        return {"$dataclass": spell(type(value)), "fields": fields}
    raise EncodeError(f"{key} is a {type(value).__module__}.{type(value).__qualname__}, which a repro cannot store")


def _encode_module(module: nn.Module, weights: dict[str, torch.Tensor], prefix: str, key: str) -> dict[str, Any]:
    attrs = {}
    for name, attr in module.__dict__.items():
        if name in _MODULE_INTERNALS:
            continue
        try:
            attrs[name] = encode(attr, weights, weights, f"{prefix}{name}", "$weight")
        except EncodeError as exc:
            raise EncodeError(f"{type(module).__name__} at {key} holds {name!r}: {exc}") from None
    for name, param in module._parameters.items():
        if param is not None:
            weights[f"{prefix}{name}"] = param.detach().to("cpu").contiguous()
    for name, buffer in module._buffers.items():
        if buffer is not None:
            weights[f"{prefix}{name}"] = buffer.detach().to("cpu").contiguous()
    return {
        "class": spell(type(module)),
        "prefix": prefix,
        "training": module.training,
        "attrs": attrs,
        "parameters": [n for n, p in module._parameters.items() if p is not None],
        "buffers": [n for n, b in module._buffers.items() if b is not None],
        "non_persistent": sorted(module._non_persistent_buffers_set),
        "children": {
            name: None if child is None else _encode_module(child, weights, f"{prefix}{name}.", f"{key}.{name}")
            for name, child in module._modules.items()
        },
    }


class Decoder:
    """Rebuilds encoded values; `packages`: the top-level packages whose functions may be called."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        weights: Mapping[str, torch.Tensor],
        *,
        packages: tuple[str, ...],
        device: str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        self.tensors, self.weights, self.packages = tensors, weights, packages
        self.device, self.dtype = device, dtype

    def _tensor(self, store: Mapping[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
        if key not in store:
            raise ReproError(f"{what} has no tensor {key!r}: the file is not the one this repro was written with")
        tensor = store[key].to(self.device)
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor

    def value(self, data: Any) -> Any:
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if isinstance(data, list):
            return [self.value(v) for v in data]
        if not isinstance(data, dict) or len(data) < 1:
            raise ReproError(f"calls.json holds {type(data).__name__} {str(data)[:60]!r} where a value was expected")
        tag = next(iter(data))
        if tag == "$tensor":
            return self._tensor(self.tensors, str(data["$tensor"]), "inputs.safetensors")
        if tag == "$weight":
            return self._tensor(self.weights, str(data["$weight"]), "weights.safetensors")
        if tag == "$type":
            if data["$type"] not in _PLAIN_TYPES:
                raise ReproError(f"calls.json names type {data['$type']!r}; a repro holds only {', '.join(_PLAIN_TYPES)}")
            return _PLAIN_TYPES[data["$type"]]
        if tag in ("$numpy", "$numpy_scalar", "$numpy_type"):
            import numpy

            if tag == "$numpy_type":
                return numpy.dtype(str(data["$numpy_type"])).type
            if tag == "$numpy_scalar":
                return numpy.dtype(str(data["dtype"])).type(data["$numpy_scalar"])
            store = self.weights if data.get("store") == "$weight" else self.tensors
            if str(data["$numpy"]) not in store:
                raise ReproError(f"a safetensors file has no tensor {data['$numpy']!r}: not the one this repro was written with")
            return store[str(data["$numpy"])].numpy()
        if tag == "$module":
            return self.module(data["$module"])
        if tag == "$dtype":
            dtype = getattr(torch, str(data["$dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ReproError(f"calls.json names dtype {data['$dtype']!r}, which torch does not have")
            return dtype
        if tag == "$device":
            return torch.device(str(data["$device"]))
        if tag == "$size":
            return torch.Size(int(v) for v in data["$size"])
        if tag == "$tuple":
            return tuple(self.value(v) for v in data["$tuple"])
        if tag == "$dict":
            return {k: self.value(v) for k, v in data["$dict"]}
        if tag == "$enum":
            enum_cls = self.type_of(data["$enum"], enum.Enum, "an Enum")
            return enum_cls[data["name"]]
        if tag == "$namedtuple":
            tuple_cls = self.type_of(data["$namedtuple"], tuple, "a NamedTuple")
            return tuple_cls(*(self.value(v) for v in data["fields"]))
        if tag == "$dataclass":
            cls = self.type_of(data["$dataclass"], object, "a dataclass")
            if not dataclasses.is_dataclass(cls):
                raise ReproError(f"calls.json names {data['$dataclass']!r} as a dataclass; it is not one")
            return cls(**{k: self.value(v) for k, v in data["fields"].items()})
        raise ReproError(f"calls.json holds an unknown tag {tag!r}")

    def module(self, data: Mapping[str, Any]) -> nn.Module:
        cls = self.type_of(data["class"], nn.Module, "an nn.Module")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        for name, attr in data["attrs"].items():
            object.__setattr__(module, name, self.value(attr))
        prefix = data["prefix"]
        for name in data["parameters"]:
            module._parameters[name] = nn.Parameter(
                self._tensor(self.weights, prefix + name, "weights.safetensors"), requires_grad=False
            )
        for name in data["buffers"]:
            module._buffers[name] = self._tensor(self.weights, prefix + name, "weights.safetensors")
        module._non_persistent_buffers_set.update(data["non_persistent"])
        for name, child in data["children"].items():
            module._modules[name] = None if child is None else self.module(child)
        module.train(bool(data["training"]))
        return module

    def type_of(self, spec: str, base: type[T], what: str) -> type[T]:
        obj = resolve_name(spec, self.packages, kind="class")
        if not isinstance(obj, type) or not issubclass(obj, base):
            raise ReproError(f"calls.json names {spec!r} as {what}; it is a {type(obj).__name__}")
        return obj

    def function(self, spec: str) -> Any:
        obj = resolve_name(spec, self.packages, kind="function")
        if not isinstance(obj, types.FunctionType):
            raise ReproError(
                f"calls.json names {spec!r} as a stage's function; it is a {type(obj).__name__}, not a Python function"
            )
        return obj


def _top(module_name: str) -> str:
    return module_name.partition(".")[0]


def resolve_name(spec: str, packages: tuple[str, ...], *, kind: str) -> Any:
    """The class, function or target factory `package.module:Qualified.name`, imported only from
    outside the standard library; a stage's function only from `packages` (the target's and the
    built-in model packages), a factory (the run's target) from none of the packages whose
    functions a repro never calls."""
    module_name, sep, qualname = str(spec).partition(":")
    if not sep or not module_name or not qualname:
        raise ReproError(f"calls.json names {spec!r}, not 'package.module:name'")
    top = _top(module_name)
    if top in sys.stdlib_module_names or top == "builtins":
        raise ReproError(f"calls.json names {spec!r}: a repro never imports the standard library (refused)")
    if kind == "factory" and top in _NEVER_CALLED:
        raise ReproError(f"calls.json names {spec!r} as the run's target: a repro never calls into {top} (refused)")
    if kind == "function" and (top in _NEVER_CALLED or top not in packages):
        allowed = ", ".join(packages) or "none"
        raise ReproError(
            f"calls.json names function {spec!r}: a repro calls functions of the target's packages only ({allowed}) (refused)"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise MissingPackage(module_name, exc) from None
    for part in qualname.split("."):
        if part.startswith("__") or not hasattr(obj, part):
            raise ReproError(f"calls.json names {spec!r}, which {module_name} does not define here (a different version of it?)")
        obj = getattr(obj, part)
    return obj


class MissingPackage(ReproError):
    """A module the repro's calls need is not importable where the repro runs."""

    def __init__(self, module: str, exc: ImportError) -> None:
        super().__init__(f"{module} cannot be imported here ({type(exc).__name__}: {exc})")
        self.module = module
