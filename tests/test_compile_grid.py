"""Compile-only builds of examples/compile_grid.yaml: every spec axis (head dims, chunk
sizes, block widths, io dtypes, both gates, the fused conv, an ops subset) compiles for
gfx90a, gfx942 (through gfx940 here) and sm_90."""

import shutil
from pathlib import Path

import pytest

from kdagen.build import build_many
from kdagen.variants import expand_file

GRID = Path(__file__).resolve().parent.parent / "examples" / "compile_grid.yaml"


@pytest.mark.compile
def test_compile_grid_builds_for_every_target(tmp_path, monkeypatch):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "cache"))
    specs = expand_file(GRID).specs
    have = {"amd": shutil.which("hipcc") is not None, "nvidia": shutil.which("nvcc") is not None}
    specs = [s for s in specs if have[s.target_info.vendor]]
    if not specs:
        pytest.skip("neither hipcc nor nvcc is installed")
    assert len({s.target for s in specs}) >= 2 or not all(have.values())
    entries = build_many(specs, "objects")
    for e in entries:
        assert e.problem() is None, (e.name, e.problem())
        assert e.kernels_object.stat().st_size > 10_000
