"""Just in time: build a variant if needed, load it, register its fake impls.

``kdagen.load(spec)`` returns a :class:`~kdagen.ops.Kernels` handle. The library is
checked against its manifest (sha256) before ``dlopen``, so a truncated or corrupted
file is rebuilt instead of crashing the process.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import torch

from .build import BuildError, Entry, _invalidate, build, resource_constants
from .groups import cuda_index
from .ops import Kernels
from .spec import KernelSpec, spec_from_any

_lock = threading.Lock()
_loaded: dict[str, tuple[str, Kernels]] = {}
_loaded_specs: dict[tuple, Kernels] = {}  # (spec uri, resource constants) -> handle


def device_target(device: torch.device | None = None) -> str:
    """The kdagen target of a GPU (``KDAGEN_ARCH`` overrides)."""
    forced = os.environ.get("KDAGEN_ARCH")
    if forced:
        return forced.split(",")[0].strip()
    if not torch.cuda.is_available():
        raise RuntimeError("no GPU: torch.cuda.is_available() is False; set KDAGEN_ARCH or use "
                           "`kdagen build --compile-only`")
    index = cuda_index(device)
    props = torch.cuda.get_device_properties(index)
    arch = getattr(props, "gcnArchName", "") or ""
    if getattr(torch.version, "hip", None) and arch:
        return arch.split(":")[0]
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) == (9, 0):
        return "sm_90"
    raise RuntimeError(f"GPU {props.name} (sm_{major}{minor}) is not a kdagen target; "
                       "kdagen generates code for gfx90a, gfx942, gfx950 and sm_90")


def load(spec: KernelSpec | dict | str | Path, *, verbose: bool | None = None,
         force: bool | None = None) -> Kernels:
    """Build (if missing) and load a variant; return its op handle."""
    spec = spec_from_any(spec)
    with _lock:
        # loaded before in this process with the same constants: its ops are bound for good
        # (torch ops cannot be replaced), so no planning, hashing or rebuilding on each call
        # (kda_forward loads its variant on every forward pass)
        loaded_key = (spec.uri, resource_constants())
        seen = _loaded_specs.get(loaded_key)
        if seen is not None:
            return seen
        entry = build(spec, "full", verbose=verbose, force=force)
        have = _loaded.get(spec.name)
        if have is not None:
            if have[0] != entry.key:
                raise RuntimeError(
                    f"{spec.name} is already loaded from another build ({have[1].library}); torch "
                    "ops cannot be replaced inside a process: restart it to use the new build"
                )
            return have[1]
        _dlopen(entry, verbose=verbose)
        ns = torch.ops.kdagen
        ops = {op: getattr(ns, f"{spec.name}_{op}") for op in spec.ops}
        _register_fakes(spec)
        residency = (getattr(ns, f"{spec.name}_chunk_residency") if "chunk" in spec.ops else None)
        handle = Kernels(spec, ops, str(entry.library), residency=residency)
        _loaded[spec.name] = (entry.key, handle)
        _loaded_specs[loaded_key] = handle
        return handle


def _dlopen(entry: Entry, *, verbose: bool | None) -> None:
    problem = entry.problem()
    if problem is not None:  # damaged after the build returned: rebuild once
        _invalidate(entry)
        entry = build(entry.spec, "full", verbose=verbose, force=True)
    try:
        torch.ops.load_library(str(entry.library))
    except OSError as e:
        _invalidate(entry)
        raise BuildError(f"cannot load {entry.library}: {e}; the entry was invalidated, the next "
                         "load rebuilds it") from None


def _register_fakes(spec: KernelSpec) -> None:
    """Meta implementations: every op only writes into tensors its schema marks mutable."""
    for op in spec.ops:
        name = f"kdagen::{spec.name}_{op}"

        def fake(*args: object, **kwargs: object) -> None:
            return None

        torch.library.register_fake(name)(fake)


def for_inputs(head_dim: int, dtype: torch.dtype, device: torch.device, *, lower_bound: float | None,
               conv_width: int = 0, chunk_size: int = 64, block_width: int | None = None) -> Kernels:
    """The variant that fits a call: head dim, io dtype and gate form from the inputs,
    target from the device."""
    return load(spec_for_inputs(head_dim, dtype, device, lower_bound=lower_bound,
                                conv_width=conv_width, chunk_size=chunk_size, block_width=block_width))


def spec_for_inputs(head_dim: int, dtype: torch.dtype, device: torch.device, *,
                    lower_bound: float | None, conv_width: int = 0, chunk_size: int = 64,
                    block_width: int | None = None) -> KernelSpec:
    """The spec ``for_inputs`` loads (nothing is built)."""
    io = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype)
    if io is None:
        raise TypeError(f"kdagen: inputs must be bf16, fp16 or fp32, got {dtype}")
    gate = "softplus" if lower_bound is None else "lower_bound"
    return _parsed_spec(head_dim, chunk_size, io, conv_width, gate, device_target(device), block_width,
                        resource_constants())


@functools.lru_cache(maxsize=256)
def _parsed_spec(head_dim: int, chunk_size: int, io: str, conv_width: int, gate: str, target: str,
                 block_width: int | None, constants: tuple) -> KernelSpec:
    """``KernelSpec.parse`` of these fields, once per value of the resource constants
    (which the validator reads): the spec is frozen, kda_forward asks on every call; a
    refusal is not kept, it raises again."""
    fields: dict = dict(head_dim=head_dim, chunk_size=chunk_size, io_dtype=io,
                        conv_width=conv_width, gate=gate, target=target)
    if block_width is not None:
        fields["block_width"] = block_width
    return KernelSpec.parse(fields)
