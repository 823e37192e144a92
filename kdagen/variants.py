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


def expand(grid: dict[str, Any], *, pattern: str | None = None, source: str = "grid",
           nested: bool = False, outer: str | None = None) -> Expansion:
    """Expand a grid (or ``grids:``, a list of grids whose union is taken). A variant is
    kept where its name matches ``pattern`` (the command line's) or else the file-wide
    filter (a lone grid's ``filter``, or the one beside ``grids``: ``outer`` for a
    ``nested`` grid), and a nested grid's own ``filter`` as well. Field names the spec
    does not have are errors, not prunings."""
    if isinstance(grid, dict) and "grids" in grid:
        if set(grid) - {"grids", "filter"} or not isinstance(grid["grids"], list) or not grid["grids"]:
            raise SpecError(f"{source}: 'grids' must be a list of grids (and only 'filter' beside "
                            "it), not empty")
        top = _filter(grid, source)
        specs, pruned, seen = [], [], set()
        for i, sub in enumerate(grid["grids"]):
            e = expand(sub, pattern=pattern, source=f"{source}: grids[{i}]", nested=True, outer=top)
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
    if "grid" not in grid and "base" not in grid:
        raise SpecError(f"{source}: a grid file needs 'grid', a mapping of spec fields to lists of "
                        "values, or 'base' alone for one variant; an empty grid names none")
    base = grid.get("base", {})
    axes = grid.get("grid", {})
    if not isinstance(base, dict) or not isinstance(axes, dict):
        raise SpecError(f"{source}: 'base' and 'grid' must be mappings")
    known = KernelSpec.model_fields
    for where, keys in (("base", base), ("grid", axes)):
        unknown_fields = [k for k in keys if k not in known]
        if unknown_fields:
            raise SpecError(f"{source}: {where} field(s) {', '.join(map(repr, unknown_fields))} are "
                            f"not spec fields; known fields: {', '.join(known)}")
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{source}: grid field {key!r} must be a non-empty list, got {values!r}")
    own = _filter(grid, source)
    # the command line's pattern replaces the file-wide filter; a nested grid's own stays
    patterns = [p for p in ([pattern or outer, own] if nested else [pattern or own]) if p]
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
        if not all(fnmatch.fnmatch(spec.name, p) for p in patterns):
            continue
        if spec.uri not in seen:
            seen.add(spec.uri)
            specs.append(spec)
    return Expansion(specs, pruned)


def _filter(grid: dict[str, Any], source: str) -> str | None:
    """A grid's (or ``grids``'s) ``filter``: a name pattern string, or None."""
    pattern = grid.get("filter")
    if pattern is not None and not isinstance(pattern, str):
        raise SpecError(f"{source}: 'filter' must be a name pattern string, got {pattern!r}")
    return pattern


def expand_file(path: str | Path, *, pattern: str | None = None) -> Expansion:
    path = Path(path)
    return expand(load_yaml(path), pattern=pattern, source=str(path))
