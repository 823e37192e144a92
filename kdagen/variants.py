"""Grids of specs: enumerate every combination, prune what cannot exist, filter.

A grid file::

    base: {chunk_size: 64}          # fields every variant shares (optional)
    grid:                           # each field a list of values; the product is taken
      head_dim: [64, 128]
      io_dtype: [bf16, fp16]
      target: [sm_90, gfx942]
    filter: "*_bf16_*"              # optional fnmatch pattern on variant names

or ``grids: [grid, grid, ...]`` for a union. Combinations the validator refuses are pruned, each with its reason.
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import KernelSpec, SpecError, load_yaml


@dataclass(frozen=True)
class Expansion:
    specs: list[KernelSpec]
    pruned: list[tuple[dict[str, Any], str]]  # (fields, reason)


def expand(grid: dict[str, Any], *, pattern: str | None = None, source: str = "grid") -> Expansion:
    """Expand a grid (or ``grids:``, a list of grids whose union is taken)."""
    if isinstance(grid, dict) and "grids" in grid:
        if set(grid) - {"grids", "filter"} or not isinstance(grid["grids"], list):
            raise SpecError(f"{source}: 'grids' must be a list of grids (and only 'filter' beside it)")
        specs, pruned, seen = [], [], set()
        for i, sub in enumerate(grid["grids"]):
            e = expand(sub, pattern=pattern or grid.get("filter"), source=f"{source}: grids[{i}]")
            pruned += e.pruned
            for s in e.specs:
                if s.uri not in seen:
                    seen.add(s.uri)
                    specs.append(s)
        return Expansion(specs, pruned)
    if not isinstance(grid, dict):
        raise SpecError(f"{source}: a grid file is a mapping with 'grid' (and optional 'base', "
                        "'filter')")
    unknown = set(grid) - {"base", "grid", "filter"}
    if unknown:
        raise SpecError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}; a grid file has "
                        "'base', 'grid' and 'filter'")
    base = grid.get("base") or {}
    axes = grid.get("grid") or {}
    if not isinstance(base, dict) or not isinstance(axes, dict):
        raise SpecError(f"{source}: 'base' and 'grid' must be mappings")
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{source}: grid field {key!r} must be a non-empty list, got {values!r}")
    pattern = pattern or grid.get("filter")
    if pattern is not None and not isinstance(pattern, str):
        raise SpecError(f"{source}: 'filter' must be a name pattern string, got {pattern!r}")
    names = list(axes)
    specs: list[KernelSpec] = []
    pruned: list[tuple[dict[str, Any], str]] = []
    seen: set[str] = set()
    for combo in itertools.product(*(axes[n] for n in names)):
        fields = {**base, **dict(zip(names, combo))}
        try:
            spec = KernelSpec.parse(fields, source=source)
        except SpecError as e:
            pruned.append((fields, str(e).split("invalid spec: ", 1)[-1]))
            continue
        if pattern and not fnmatch.fnmatch(spec.name, pattern):
            continue
        if spec.uri not in seen:
            seen.add(spec.uri)
            specs.append(spec)
    return Expansion(specs, pruned)


def expand_file(path: str | Path, *, pattern: str | None = None) -> Expansion:
    path = Path(path)
    return expand(load_yaml(path), pattern=pattern, source=str(path))
