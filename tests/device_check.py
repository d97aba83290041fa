"""Catch accelerator mistakes on a CPU-only machine: mixed-device operations and host synchronisations.

There is no GPU in the test environment, and torch's fake devices do not help: ``FakeTensorMode(device=
"cuda")`` fails on a CPU build of torch 2.13 (``F.pad``, then autograd aborts) and initialises CUDA on
2.3.1; the meta device catches host reads but allows ``cpu_tensor += meta_tensor``. So the step runs on
the CPU for real while every tensor is labelled with where it would live on a GPU machine:

* ``DEVICE``: the model's parameters and buffers (:meth:`DeviceCheck.place_model`), tensors moved "to
  the device" (``Tensor.to`` with a device or tensor argument), factory calls given a ``device=``, and
  everything computed from a DEVICE tensor (autograd's gradients included);
* ``HOST``: factory calls without a device (``torch.zeros(n)``, ``torch.tensor([...])``) or with the
  string ``"cpu"`` (``device="cpu"``, ``.to("cpu")``: code that means the host spells it out, where code
  that means the model's device passes a ``torch.device`` such as ``p.device``), ``.cpu()`` copies, and
  what is computed from host tensors only.

An operation that combines a DEVICE tensor with a HOST tensor of one or more dimensions raises
:class:`DeviceMixError` naming the op and the moeflow line: CUDA raises there too (0-dim CPU tensors are
allowed, as CUDA allows them). ``copy_`` is exempt (a host-to-device copy is legal). Tensors made
inside composite ops at the dispatch level carry no label and never fail a check.

Host synchronisations of DEVICE tensors are recorded in :attr:`DeviceCheck.syncs`: scalar reads
(``item``, ``float``, ``int``, ``bool``), ``.cpu()``, ``.tolist()``, ``.numpy()``, ops whose output
size depends on the data (``nonzero``, ``masked_select``, ``bincount``, ``unique``) and boolean-mask
indexing.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEVICE, HOST = "device", "host"
_LABEL = "_device_check_place"

aten = torch.ops.aten
# Ops whose result a GPU must hand to the host before the host can go on.
SYNC_OPS = {
    aten._local_scalar_dense.default: "scalar read (item/float/int/bool)",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount (sizes its output from the data)",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.equal.default: "equal",
}
INDEX_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)
HOST_COPIES = {torch.Tensor.cpu: ".cpu()", torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()"}
FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.tensor,
    torch.as_tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.eye,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
}


class DeviceMixError(AssertionError):
    """An operation mixed tensors standing for device tensors with host tensors."""


def place_of(t: Any) -> str | None:
    return getattr(t, _LABEL, None) if isinstance(t, torch.Tensor) else None


def _label(tree: Any, place: str) -> None:
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, _LABEL, place)


def _where() -> str:
    """The innermost moeflow line of the current Python stack (else the innermost non-torch line)."""
    frames = [f for f in traceback.extract_stack() if "device_check" not in f.filename]
    ours = [f for f in frames if "/moeflow/" in f.filename] or [f for f in frames if "/torch/" not in f.filename]
    f = ours[-1] if ours else frames[-1]
    name = f.filename.split("/moeflow/")[-1] if "/moeflow/" in f.filename else f.filename.rsplit("/", 1)[-1]
    return f"{name}:{f.lineno} in {f.name}"


def _describe(tensors: Iterable[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)


def _origin() -> str:
    """Whose code asked for it: the innermost frame outside torch in moeflow, transformers or elsewhere."""
    frames = [f for f in traceback.extract_stack() if "device_check" not in f.filename and "/torch/" not in f.filename]
    innermost = frames[-1].filename if frames else ""
    return next((name for name in ("transformers", "moeflow") if f"/{name}/" in innermost), "other")


@dataclass
class Sync:
    what: str
    where: str  # the innermost moeflow line
    origin: str  # moeflow, transformers or other (see _origin)


class _Dispatch(TorchDispatchMode):
    def __init__(self, check: DeviceCheck):
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if place_of(t) == DEVICE]
        on_host = [t for t in tensors if place_of(t) == HOST and t.dim() > 0]
        if on_device and on_host and func is not aten.copy_.default:
            raise DeviceMixError(
                f"{func} mixes device tensors ({_describe(on_device)}) with host tensors ({_describe(on_host)}) "
                f"at {_where()}: on CUDA this raises 'Expected all tensors to be on the same device'"
            )
        if on_device:
            if func in SYNC_OPS:
                self.check.record(SYNC_OPS[func])
            elif func in INDEX_OPS and any(t.dtype == torch.bool for t in tensors[1:]):
                self.check.record("boolean-mask indexing (data-dependent shape)")
        out = func(*args, **kwargs)
        if func is not aten.copy_.default:
            if on_device:
                _label(out, DEVICE)
            elif any(place_of(t) == HOST for t in tensors):
                _label(out, HOST)
        return out


class _Functions(TorchFunctionMode):
    def __init__(self, check: DeviceCheck):
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_COPIES:
            if place_of(args[0]) == DEVICE:
                self.check.record(HOST_COPIES[func])
            out = func(*args, **kwargs)
            if func is torch.Tensor.cpu:
                out = out.clone() if out is args[0] else out  # a host copy, labelled apart from the original
                _label(out, HOST)
            return out
        if func is torch.Tensor.to and _destination(args[1:], kwargs) is not None:
            place = _destination(args[1:], kwargs)
            if place == HOST and place_of(args[0]) == DEVICE:
                self.check.record('.to("cpu")')
            out = func(*args, **kwargs)
            out = out.clone() if out is args[0] else out  # a copy, labelled apart from the original
            _label(out, place)
            return out
        out = func(*args, **kwargs)
        if func in FACTORIES:
            place = _destination((), kwargs)
            if place is not None:
                _label(out, place)
            elif not (args and isinstance(args[0], torch.Tensor)):  # as_tensor(t), zeros_like(t): as t is
                _label(out, HOST)
        return out


def _destination(args: tuple, kwargs: dict) -> str | None:
    """Where a ``device=`` keyword or a device/tensor argument sends a tensor: HOST for the string "cpu",
    DEVICE for any other device; None when nothing names a device (a dtype-only ``.to``)."""
    if kwargs.get("device") is not None:
        named = [kwargs["device"]]
    else:
        named = [a for a in args if isinstance(a, (torch.device, str, torch.Tensor))]
    if not named:
        return None
    return HOST if isinstance(named[0], str) and named[0].startswith("cpu") else DEVICE


class DeviceCheck:
    """``with DeviceCheck() as check: check.place_model(model); ...``: run code as if on an accelerator.

    Raises :class:`DeviceMixError` at the first mixed-device op; ``check.syncs`` lists the host
    synchronisations of device tensors, in order.
    """

    def __init__(self) -> None:
        self.syncs: list[Sync] = []
        self._modes = (_Functions(self), _Dispatch(self))

    def record(self, what: str) -> None:
        self.syncs.append(Sync(what, _where(), _origin()))

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        _label(list(model.parameters()) + list(model.buffers()), DEVICE)
        return model

    def sync_report(self, origin: str | None = None) -> str:
        """The recorded synchronisations (of one origin: moeflow, transformers, other), one a line."""
        return "\n".join(f"  {s.what} at {s.where} ({s.origin})" for s in self.syncs if origin in (None, s.origin))

    def __enter__(self) -> DeviceCheck:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
