"""Compilers and flags: hipcc for AMD targets, nvcc for NVIDIA, torch's own paths.

The same HIP source goes to both: hipcc compiles it natively, nvcc as CUDA through
kdagen's ``hip_on_cuda.h``. Everything that changes the produced binary (compiler
identity, flags, arch, torch) feeds the build cache key.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .targets import Target


class ToolchainError(RuntimeError):
    """A compiler or runtime kdagen needs is missing; the message says what to install."""


@dataclass(frozen=True)
class DeviceCompiler:
    """How to turn kernels.hip into an object for one arch."""

    vendor: str
    path: str
    version: str
    arch: str  # what the compiler is told (gfx940 when checking gfx942 with an old clang)
    flags: tuple[str, ...] = field(default=())
    note: str = ""  # said to the user, e.g. an arch substitution

    def compile_command(self, src: str, obj: str, include: str, depfile: str) -> list[str]:
        if self.vendor == "nvidia":
            return [
                self.path, "-x", "cu", "-std=c++17", "-O3",
                f"-gencode=arch=compute_{self.arch.removeprefix('sm_')},code={self.arch}",
                "--expt-relaxed-constexpr", "-Xptxas", "-v", "-Xcompiler", "-fPIC",
                f"-I{include}", "-MD", "-MF", depfile, *self.flags, "-c", src, "-o", obj,
            ]
        return [
            self.path, "-x", "hip", "-std=c++17", "-O3", f"--offload-arch={self.arch}", "-fPIC",
            "-Rpass-analysis=kernel-resource-usage", f"-I{include}", "-MD", "-MF", depfile,
            *self.flags, "-c", src, "-o", obj,
        ]


def _version(cmd: list[str], env: dict[str, str] | None = None) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"cannot run {cmd[0]}: {e}") from None
    text = (out.stdout + out.stderr).strip()
    lines = [ln for ln in text.splitlines() if "version" in ln.lower() or "release" in ln.lower()]
    return " | ".join(lines) or text[-200:]


def hip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HIP_PLATFORM", "amd")
    return env


def _named(var: str) -> str | None:
    """The compiler a KDAGEN_* variable names: a file, or a ToolchainError (never a quiet
    fall back to another compiler)."""
    path = os.environ.get(var)
    if path and not Path(path).is_file():
        raise ToolchainError(f"{var}={path} is not a file: point it at the compiler, or unset it")
    return path or None


@lru_cache(maxsize=None)
def find_nvcc() -> str:
    cands = [_named("KDAGEN_NVCC"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            cands.append(str(Path(home) / "bin" / "nvcc"))
    for c in cands:
        if c and Path(c).is_file():
            return c
    raise ToolchainError(
        "nvcc not found: install the CUDA toolkit (12.4 or newer) or set KDAGEN_NVCC / CUDA_HOME"
    )


@lru_cache(maxsize=None)
def find_hipcc() -> str:
    cands = [_named("KDAGEN_HIPCC"), shutil.which("hipcc")]
    for home in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if home:
            cands.append(str(Path(home) / "bin" / "hipcc"))
    for c in cands:
        if c and Path(c).is_file():
            return c
    raise ToolchainError(
        "hipcc not found: install ROCm, or on Debian `apt-get install hipcc libamdhip64-dev "
        "rocm-device-libs`, or set KDAGEN_HIPCC"
    )


@lru_cache(maxsize=None)
def compiler_version(path: str, vendor: str) -> str:
    return _version([path, "--version"], env=hip_env() if vendor == "amd" else None)


@lru_cache(maxsize=None)
def hipcc_knows(path: str, arch: str) -> bool:
    """Whether this hipcc's clang can target ``arch`` (Debian's ROCm 5.2 stops at gfx940)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kdagen-probe-") as tmp:
        src = Path(tmp) / "probe.hip"
        src.write_text("\n")
        try:
            out = subprocess.run(
                [path, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only",
                 "-fsyntax-only", str(src)],
                capture_output=True, text=True, timeout=60, env=hip_env(),
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return out.returncode == 0 and "invalid target" not in out.stderr


# Variables the compilers read themselves, which change what they build: part of the
# cache key (kdagen/build.py), so a build under one is never reused without it.
COMPILER_ENV = ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN", "HIPCC_COMPILE_FLAGS_APPEND",
                "HIPCC_LINK_FLAGS_APPEND", "HIP_CLANG_PATH", "HIP_PLATFORM", "HIP_PATH", "ROCM_PATH",
                "CUDA_HOME", "CUDA_PATH")


def compiler_env() -> dict[str, str]:
    """The COMPILER_ENV variables that are set."""
    return {k: os.environ[k] for k in COMPILER_ENV if os.environ.get(k)}


def extra_device_flags() -> tuple[str, ...]:
    """``KDAGEN_DEVICE_FLAGS``: extra device-compiler flags (e.g. ``-lineinfo`` for a
    profiler); they are part of the cache key like every other flag."""
    return tuple(shlex.split(os.environ.get("KDAGEN_DEVICE_FLAGS", "")))


def device_compiler(target: Target, *, allow_substitute: bool = False) -> DeviceCompiler:
    """The compiler for ``target``; with ``allow_substitute`` an old hipcc may check
    gfx942/gfx950 through the target's ``check_arch`` (compile-only builds say so)."""
    if target.vendor == "nvidia":
        path = find_nvcc()
        return DeviceCompiler("nvidia", path, compiler_version(path, "nvidia"), target.arch,
                              extra_device_flags())
    path = find_hipcc()
    version = compiler_version(path, "amd")
    arch, note = target.arch, ""
    if not hipcc_knows(path, arch):
        if not (allow_substitute and target.check_arch):
            raise ToolchainError(
                f"{path} cannot target {arch} ({version}); use a ROCm with {arch} support"
            )
        arch = target.check_arch
        note = f"{path} does not know {target.arch}; compile-checked through {arch} (same ISA family)"
    flags = (f"-DKDAGEN_CHECK_ARCH_SUBSTITUTED={target.arch}",) if note else ()
    flags += extra_device_flags()
    return DeviceCompiler("amd", path, version, arch, flags, note)


# ---- the torch side (binding + link), only for full builds --------------------------------


@dataclass(frozen=True)
class TorchToolchain:
    cxx: str
    flavour: str  # "cuda" or "rocm"
    torch_version: str
    include_dirs: tuple[str, ...]
    library_dirs: tuple[str, ...]
    libraries: tuple[str, ...]
    defines: tuple[str, ...]


def torch_flavour() -> str | None:
    import torch

    if getattr(torch.version, "hip", None):
        return "rocm"
    if torch.version.cuda:
        return "cuda"
    return None


def torch_toolchain(target: Target) -> TorchToolchain:
    """Compiler, include and link settings for the binding, from torch.utils.cpp_extension."""
    import torch
    from torch.utils import cpp_extension

    flavour = torch_flavour()
    want = "cuda" if target.vendor == "nvidia" else "rocm"
    if flavour is None:
        raise ToolchainError(
            f"this torch ({torch.__version__}) is a CPU build: a loadable {target.name} library "
            "needs a CUDA or ROCm torch; on this machine use `kdagen build --compile-only`"
        )
    if flavour != want:
        raise ToolchainError(
            f"target {target.name} needs a {want.upper()} torch, this torch is {flavour.upper()} "
            f"({torch.__version__}); pick a target of this GPU or use --compile-only"
        )
    incs = list(cpp_extension.include_paths())
    libdirs = list(cpp_extension.library_paths())
    py_inc = sysconfig.get_paths()["include"]
    incs.append(py_inc)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    if flavour == "cuda":
        home = cpp_extension.CUDA_HOME or str(Path(find_nvcc()).parent.parent)
        incs.append(str(Path(home) / "include"))
        for sub in ("lib64", "lib", "lib64/stubs"):
            if (Path(home) / sub).is_dir():
                libdirs.append(str(Path(home) / sub))
        libs = ("c10", "torch", "torch_cpu", "c10_cuda", "torch_cuda", "cudart")
    else:
        home = cpp_extension.ROCM_HOME or "/opt/rocm"
        incs.append(str(Path(home) / "include"))
        libdirs.append(str(Path(home) / "lib"))
        libs = ("c10", "torch", "torch_cpu", "c10_hip", "torch_hip", "amdhip64")
        defines += ["-DUSE_ROCM=1", "-D__HIP_PLATFORM_AMD__=1"]
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise ToolchainError("no C++ compiler (c++ / g++) on PATH for the torch binding")
    return TorchToolchain(
        cxx, flavour, torch.__version__, tuple(incs), tuple(libdirs), libs, tuple(defines)
    )
