"""Run a variant's generated kernels on the CPU, through the emulation of
``templates/include/kdagen/emulate.h`` (one std::thread per GPU thread, the ISA's matrix
layouts, NaN-filled shared memory).

``emulated(spec)`` renders the spec, compiles its ``kernels.hip`` as C++20 with clang
(``-DKDAGEN_EMULATE``, plus ``-DKDAGEN_EMULATE_NVIDIA`` for sm_90) and returns a
:class:`~kdagen.ops.Kernels` handle whose ops fill the launch structs from CPU tensors as
the torch binding does, so every Python check and allocation of the real ops runs too.
It is for tests: a 64-token chunk of a d128 variant takes about a second.
"""

from __future__ import annotations

import ctypes as ct
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .groups import segments_of
from .ops import Kernels
from .render import render, symbol_prefix
from .spec import KernelSpec, spec_from_any


class EmulationError(RuntimeError):
    """No C++20 clang, or the emulated build failed."""


P = ct.c_void_p


class Strided(ct.Structure):
    _fields_ = [("ptr", P), ("token", ct.c_int64), ("head", ct.c_int64)]


class RecurrentArgs(ct.Structure):
    _fields_ = [(n, Strided) for n in ("q", "k", "v", "g", "beta")] + \
        [(n, P) for n in ("a_log", "dt_bias", "state", "state_indices", "out")] + \
        [(n, ct.c_int32) for n in ("num_seqs", "num_heads", "num_slots")] + \
        [("scale", ct.c_float), ("lower_bound", ct.c_float)]


class PrologueArgs(ct.Structure):
    _fields_ = [(n, Strided) for n in ("q", "k", "v", "g", "beta")] + \
        [(n, P) for n in ("a_log", "dt_bias", "qg", "w", "u", "kg_t", "aqk", "decay", "akk",
                          "cu_seqlens", "chunk_indices", "conv_weight", "conv_state",
                          "conv_state_indices", "conv_has_initial_state")] + \
        [(n, ct.c_int32) for n in ("num_chunks", "num_heads", "num_seqs", "num_conv_slots")] + \
        [("scale", ct.c_float), ("lower_bound", ct.c_float)]


class ChunkArgs(ct.Structure):
    _fields_ = [("qg", P), ("w", P), ("u", Strided)] + \
        [(n, P) for n in ("kg_t", "aqk", "decay", "akk", "out", "cu_seqlens",
                          "chunk_offsets", "initial_state", "final_state", "state_cache",
                          "state_indices", "has_initial_state", "checkpoint_state",
                          "checkpoint_offsets", "checkpoint_state_indices", "workspace")] + \
        [(n, ct.c_int32) for n in ("num_seqs", "num_heads", "num_groups", "num_slots",
                                   "num_checkpoint_rows", "num_segments")] + [("scale", ct.c_float)]


STRUCTS = {"recurrent": RecurrentArgs, "prologue": PrologueArgs, "chunk": ChunkArgs}


def find_clang() -> str:
    """A clang++ that takes C++20 (``KDAGEN_EMULATE_CXX`` overrides)."""
    for c in (os.environ.get("KDAGEN_EMULATE_CXX"), "clang++-15", "/usr/lib/llvm-15/bin/clang++",
              "clang++"):
        if c and (shutil.which(c) or Path(c).is_file()):
            return shutil.which(c) or c
    raise EmulationError("no clang++ for the CPU emulation (Debian: apt-get install clang-15, "
                         "which hipcc pulls in; or set KDAGEN_EMULATE_CXX)")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _strided(t: torch.Tensor, a: int, b: int) -> Strided:
    return Strided(t.data_ptr(), t.stride(a), t.stride(b))


def _check(code: int, op: str) -> None:
    if code != 0:
        raise EmulationError(f"emulated {op} returned {code}")


def _ops(lib: ct.CDLL, spec: KernelSpec) -> dict:
    sym = symbol_prefix(spec)
    ops = {}
    if "recurrent" in spec.ops:
        def recurrent(q, k, v, raw_g, raw_beta, A_log, dt_bias, state_cache, state_indices, out,
                      scale, lower_bound, f=getattr(lib, f"{sym}_recurrent")):
            a = RecurrentArgs(_strided(q, 0, 1), _strided(k, 0, 1), _strided(v, 0, 1),
                              _strided(raw_g, 0, 1), _strided(raw_beta, 0, 1), A_log.data_ptr(),
                              dt_bias.data_ptr(), state_cache.data_ptr(), state_indices.data_ptr(),
                              out.data_ptr(), q.shape[0], q.shape[1], state_cache.shape[0], scale,
                              lower_bound)
            _check(f(ct.byref(a), None), "recurrent")

        ops["recurrent"] = recurrent
    if "prologue" in spec.ops:
        def prologue(q, k, v, raw_g, raw_beta, A_log, dt_bias, qg, w, u, kg_t, aqk, decay,
                     cu_seqlens, chunk_indices, conv_weight, conv_state, conv_state_indices,
                     conv_has_initial_state, scale, lower_bound, akk=None,
                     f=getattr(lib, f"{sym}_prologue")):
            a = PrologueArgs(
                _strided(q, 1, 2), _strided(k, 1, 2), _strided(v, 1, 2), _strided(raw_g, 1, 2),
                _strided(raw_beta, 1, 2), A_log.data_ptr(), dt_bias.data_ptr(),
                *(_ptr(t) for t in (qg, w, u, kg_t, aqk, decay, akk)),
                *(t.data_ptr() for t in (cu_seqlens, chunk_indices)),
                *(_ptr(t) for t in (conv_weight, conv_state, conv_state_indices,
                                    conv_has_initial_state)),
                chunk_indices.shape[0], q.shape[2], cu_seqlens.numel() - 1,
                conv_state.shape[0] if conv_state is not None else 0, scale, lower_bound)
            _check(f(ct.byref(a), None), "prologue")

        ops["prologue"] = prologue
    if "chunk" in spec.ops:
        def chunk(qg, w, u, kg_t, aqk, decay, out, cu_seqlens, chunk_offsets, scale, initial_state,
                  final_state, workspace, groups, checkpoint_state, checkpoint_offsets,
                  checkpoint_state_indices, state_cache, state_indices, has_initial_state, akk=None,
                  segments=0, f=getattr(lib, f"{sym}_chunk")):
            a = ChunkArgs(
                qg.data_ptr(), w.data_ptr(), _strided(u, 1, 2),
                *(_ptr(t) for t in (kg_t, aqk, decay, akk)),
                *(t.data_ptr() for t in (out, cu_seqlens, chunk_offsets)),
                *(_ptr(t) for t in (initial_state, final_state, state_cache, state_indices,
                                    has_initial_state, checkpoint_state, checkpoint_offsets,
                                    checkpoint_state_indices, workspace)),
                cu_seqlens.numel() - 1, qg.shape[2], max(1, int(groups)),
                state_cache.shape[0] if state_cache is not None else 0,
                checkpoint_state.shape[0] if checkpoint_state is not None else 0,
                segments_of(groups, segments), scale)
            _check(f(ct.byref(a), None), "chunk")

        ops["chunk"] = chunk
    return ops


def _build_dir() -> Path:
    from .build import cache_root

    return cache_root() / "emulate"


BLOCK_ORDERS = ("shuffle", "forward", "reverse")


def block_order() -> str:
    """The order the emulated grids run their blocks in: ``KDAGEN_EMULATE_BLOCK_ORDER``,
    shuffle (the default: a fixed seed per launch), forward or reverse."""
    how = os.environ.get("KDAGEN_EMULATE_BLOCK_ORDER") or "shuffle"
    if how not in BLOCK_ORDERS:
        raise EmulationError(f"KDAGEN_EMULATE_BLOCK_ORDER={how!r} is not one of {', '.join(BLOCK_ORDERS)}")
    return how


def emulated(spec: KernelSpec | dict | str | Path, extra_source: str = "") -> Kernels:
    """Build (once per spec and template version) and load the CPU emulation of a variant.
    ``extra_source`` (tests) is compiled at the end of its kernels.hip, so that probe
    kernels can use the variant's Config and headers; its symbols are in the library at
    ``Kernels.library``."""
    block_order()  # a wrong KDAGEN_EMULATE_BLOCK_ORDER is named here, not by an abort inside a launch
    spec = spec_from_any(spec)
    rendered = render(spec)
    # keyed by what is compiled: the rendered sources (their Config follows kdagen's
    # resource constants too, not only the spec and the templates) and any extra source
    key = rendered.digest()[:12]
    if extra_source:
        key += "-" + hashlib.sha256(extra_source.encode()).hexdigest()[:8]
    root = _build_dir() / f"{spec.name}-{key}"
    lib_path = root / "emulated.so"
    if not lib_path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        rendered.write(root / "src", extra_source)
        nv = spec.target_info.vendor == "nvidia"
        tmp = root / f"emulated.so.tmp{os.getpid()}"
        cmd = [find_clang(), "-x", "c++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread",
               "-DKDAGEN_EMULATE", *(["-DKDAGEN_EMULATE_NVIDIA"] if nv else []),
               f"-I{root / 'src' / 'include'}", str(root / "src" / "kernels.hip"), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise EmulationError(f"emulated build of {spec.name} failed:\n{r.stderr[-3000:]}")
        os.replace(tmp, lib_path)
    lib = ct.CDLL(str(lib_path))
    for op in spec.ops:
        fn = getattr(lib, f"{symbol_prefix(spec)}_{op}")
        fn.restype, fn.argtypes = ct.c_int, [ct.POINTER(STRUCTS[op]), P]
    residency = None
    if "chunk" in spec.ops:
        query = getattr(lib, f"{symbol_prefix(spec)}_chunk_residency")
        query.restype, query.argtypes = ct.c_int, [ct.POINTER(ct.c_int)]

        def residency() -> tuple[int, int]:
            out = (ct.c_int * 2)()
            _check(query(out), "chunk_residency")
            return out[0], out[1]

    return Kernels(spec, _ops(lib, spec), str(lib_path), device_type="cpu", residency=residency)
