"""The torch binding (binding.cpp.j2) is only compiled in full builds, on a GPU machine;
here its CUDA flavour is checked for syntax against the installed torch's headers, so a
mistake in it fails on the CPU instead of at the next GPU session's first build.

Skips (visibly) where the CUDA runtime headers the binding's c10/cuda includes need are
not installed; a CPU torch lacks only c10/cuda's generated cmake-macros header, which a
stub stands in for."""

from __future__ import annotations

import glob
import shutil
import subprocess

import pytest

from kdagen.render import render
from kdagen.spec import KernelSpec

pytestmark = pytest.mark.compile


def _cuda_include() -> str | None:
    for pattern in ("/usr/local/cuda/include", "/usr/local/cuda-*/include", "/usr/include"):
        for d in sorted(glob.glob(pattern), reverse=True):
            if glob.glob(f"{d}/cuda_runtime_api.h"):
                return d
    return None


@pytest.mark.parametrize("fields", [
    {"target": "sm_90"},
    {"target": "sm_90", "chunk_size": 16, "gate": "lower_bound", "conv_width": 4},
    {"target": "sm_90", "ops": ["recurrent"], "io_dtype": "fp32"},
])
def test_cuda_binding_compiles(tmp_path, fields):
    cxx = shutil.which("g++") or shutil.which("c++")
    cuda = _cuda_include()
    if cxx is None or cuda is None:
        pytest.skip("no C++ compiler or no CUDA runtime headers (cuda_runtime_api.h)")
    import torch.utils.cpp_extension as ext

    folder = tmp_path / "v"
    render(KernelSpec.parse(fields)).write(folder)
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", *(f"-I{p}" for p in ext.include_paths()),
           f"-I{tmp_path / 'stub'}", f"-I{folder / 'include'}", f"-I{cuda}", str(folder / "binding.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert r.returncode == 0 and not errors, "\n".join(errors[:10]) or r.stderr[-2000:]
