"""A built wheel ships the templates and headers, not only an editable install."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_contains_templates(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("kdagen-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in ("kernels.hip.j2", "binding.cpp.j2", "include/kdagen/chunk.h",
                "include/kdagen/prologue.h", "include/kdagen/recurrent.h",
                "include/kdagen/hip_on_cuda.h", "include/kdagen/vendor_cdna.h",
                "include/kdagen/vendor_cuda.h"):
        assert f"kdagen/templates/{rel}" in names, rel
    assert "kdagen/cli.py" in names and "kdagen/reference.py" in names
