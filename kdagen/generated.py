"""generated/: the rendered sources of the shipped variants, committed for reading.

The shipped set is the grid ``examples/shipped.yaml``. ``kdagen generated`` rewrites
the folder; ``check_generated`` lists what is stale (a CPU test fails on any).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .render import render
from .spec import KernelSpec
from .variants import expand_file

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "examples" / "shipped.yaml"
GENERATED = REPO / "generated"


def shipped_specs() -> list[KernelSpec]:
    return expand_file(SHIPPED).specs


def write_generated(root: Path = GENERATED) -> list[Path]:
    specs = shipped_specs()
    keep = {s.uri for s in specs}
    root.mkdir(exist_ok=True)
    for d in root.iterdir():
        if d.is_dir() and d.name not in keep:
            shutil.rmtree(d)
    out = []
    for s in specs:
        render(s).write(root / s.uri)
        out.append(root / s.uri)
    return out


def check_generated(root: Path = GENERATED) -> list[str]:
    """Paths (relative to root) that are missing, changed or extra."""
    stale: list[str] = []
    specs = shipped_specs()
    keep = {s.uri for s in specs}
    if root.is_dir():
        stale += [d.name + "/" for d in sorted(root.iterdir()) if d.is_dir() and d.name not in keep]
    for s in specs:
        files = render(s).files
        folder = root / s.uri
        for rel, text in files.items():
            p = folder / rel
            if not p.is_file() or p.read_text() != text:
                stale.append(f"{s.uri}/{rel}")
        if folder.is_dir():
            extra = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
            stale += [f"{s.uri}/{x}" for x in sorted(extra - set(files))]
    return stale
