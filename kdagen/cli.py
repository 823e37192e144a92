"""The ``kdagen`` command line.

    kdagen build [SPEC.yaml] [--arch A ...] [--compile-only] [--report]
                                                             render + build, print artefacts
    kdagen render [SPEC.yaml] -o DIR [--arch A ...]          write the sources
    kdagen variants GRID.yaml [--filter PAT] [--list] [--report]
                                                             expand a grid, build it all in one ninja graph
    kdagen generated [--check]                               re-render generated/ (the shipped variants)
    kdagen targets                                           the GPUs kdagen knows
    kdagen cache list|clear                                  the build cache
    kdagen bench [...]                                       kdagen vs fla.ops.kda.chunk_kda (GPU)
    kdagen tune [SPEC.yaml] [--block-widths | --chunk-sizes ...] [--show]
                                                             measure group counts / widths / chunk sizes (GPU)

Errors are one paragraph and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import __version__

DEFAULT_SPEC_NOTE = "SPEC.yaml: a spec file (see examples/default.yaml); omitted: the default spec"


def _specs(path: str | None, arch: list[str] | None):
    """The spec file's (or the default) spec, once per target of ``--arch`` / KDAGEN_ARCH,
    each validated with its target in place of the file's."""
    from .spec import KernelSpec, SpecError, spec_with_target

    archs, origin = _arch_list(arch)
    if not archs:
        return [KernelSpec.from_yaml(path) if path else KernelSpec.parse({})]
    out = []
    for a in archs:
        try:
            out.append(spec_with_target(path, a))
        except SpecError as e:
            raise SpecError(f"{origin} {a}: {e}") from None
    return out


def _arch_list(arch: list[str] | None) -> tuple[list[str], str]:
    """The targets asked for and where they came from (``--arch`` or ``KDAGEN_ARCH``);
    an ``--arch`` that names none is an error."""
    if arch:
        items = [a.strip() for item in arch for a in item.split(",") if a.strip()]
        if not items:
            raise ValueError(f"--arch {' '.join(map(repr, arch))} names no target; "
                             "e.g. --arch gfx942,sm_90 (`kdagen targets` lists them)")
        return items, "--arch"
    env = os.environ.get("KDAGEN_ARCH", "")
    return [a.strip() for a in env.split(",") if a.strip()], "KDAGEN_ARCH"


def cmd_build(ns: argparse.Namespace) -> int:
    from .build import build_many

    specs = _specs(ns.spec, ns.arch)
    mode = "objects" if ns.compile_only else "full"
    entries = build_many(specs, mode, verbose=ns.verbose or None, force=ns.force or None)
    _print_artefacts(entries, ns.compile_only, ns.report)
    return 0


def _print_artefacts(entries, compile_only: bool, report: bool = False) -> None:
    """Each build's artefacts on stdout; a compile-only build says what it did not do;
    with ``report`` each variant's resource table (kdagen/resource_report.py)."""
    for e in entries:
        for a in e.artefacts():
            print(a)
    if compile_only:
        print("compile-only: device code compiled to objects; nothing was linked or loaded",
              file=sys.stderr)
    if report:
        from .resource_report import entry_resources, format_report

        for e in entries:
            print(format_report(e.name, entry_resources(e)))


def cmd_render(ns: argparse.Namespace) -> int:
    from .render import render

    for spec in _specs(ns.spec, ns.arch):
        folder = Path(ns.output) / spec.uri
        render(spec).write(folder)
        print(folder)
    return 0


def cmd_variants(ns: argparse.Namespace) -> int:
    from .build import build_many
    from .variants import expand_file

    exp = expand_file(ns.grid, pattern=ns.filter)
    for fields, why in exp.pruned:
        print(f"pruned {fields}: {why}", file=sys.stderr)
    if not exp.specs:
        print(f"kdagen: error: {ns.grid}: no variant is left after pruning and filtering",
              file=sys.stderr)
        return 1
    if ns.list:
        for s in exp.specs:
            print(s.uri)
        return 0
    mode = "objects" if ns.compile_only else "full"
    entries = build_many(exp.specs, mode, verbose=ns.verbose or None, force=ns.force or None,
                         jobs=ns.jobs)
    _print_artefacts(entries, ns.compile_only, ns.report)
    return 0


def cmd_generated(ns: argparse.Namespace) -> int:
    from .generated import check_generated, write_generated

    if ns.check:
        stale = check_generated()
        for s in stale:
            print(f"stale: {s}", file=sys.stderr)
        if stale:
            print("kdagen: error: generated/ is stale; run `kdagen generated`", file=sys.stderr)
            return 1
        print("generated/ is up to date")
        return 0
    for folder in write_generated():
        print(folder)
    return 0


def cmd_targets(ns: argparse.Namespace) -> int:
    from .targets import TARGETS

    print(f"{'target':8} {'vendor':7} {'arch':7} {'wave':>4} {'LDS/smem':>9}  matrix    description")
    for t in TARGETS.values():
        print(f"{t.name:8} {t.vendor:7} {t.arch:7} {t.wave_size:>4} {t.shared_mem:>9}  "
              f"{t.matrix:9} {t.description}")
    return 0


def cmd_cache(ns: argparse.Namespace) -> int:
    from .build import cache_root, cached_entries, clear_cache

    if ns.action == "list":
        entries = cached_entries()
        print(f"cache: {cache_root()} ({len(entries)} entries)")
        for e in entries:
            print(f"  {Path(e['path']).name:60} {e.get('mode', '?'):7} {e.get('arch', '?'):7} "
                  f"{e['bytes'] / 1e6:7.1f} MB  built {e.get('built_at', '?')}")
        return 0
    n = clear_cache()
    print(f"removed {n} entries from {cache_root()}")
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(ns)


def cmd_tune(ns: argparse.Namespace) -> int:
    from . import autotune

    if ns.show:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no GPU: the autotune cache is per device; run this on the GPU")
        path = autotune.cache_path(autotune.device_tag())
        entries = autotune.TuneCache(path).read()
        print(f"autotune cache: {path}")
        for spec_key in sorted(entries):
            for shape_key, row in sorted(entries[spec_key].items()):
                choice = ", ".join(f"{k} {row[k]}" for k in ("groups", "block_width", "chunk_size") if k in row)
                print(f"  {spec_key:42} {shape_key:14} {choice}  (ms: {row.get('ms')})")
        return 0
    import kdagen

    from .bench import DEFAULT_SHAPES, parse_shapes
    from .jit import device_target
    from .spec import load_yaml, parse_gates

    raw = load_yaml(Path(ns.spec)) if ns.spec else {}  # validated below for this GPU's target
    if not isinstance(raw, dict):
        from .spec import KernelSpec

        KernelSpec.parse(raw, source=ns.spec)  # refuses it: not a mapping
    if ns.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {ns.reps}")
    try:
        widths = [int(w) for w in ns.block_widths.split(",") if w.strip()] if ns.block_widths else []
    except ValueError:
        raise ValueError(f"--block-widths must be comma separated integers, got {ns.block_widths!r}") from None
    try:
        chunks = [int(c) for c in ns.chunk_sizes.split(",") if c.strip()] if ns.chunk_sizes else []
    except ValueError:
        raise ValueError(f"--chunk-sizes must be comma separated integers, got {ns.chunk_sizes!r}") from None
    if widths and chunks:
        raise ValueError("--block-widths and --chunk-sizes are tuned in separate runs: pass one")
    if len(set(chunks)) != len(chunks) or len(chunks) == 1:
        raise ValueError(f"--chunk-sizes needs two or more different sizes, got {ns.chunk_sizes!r}")
    gates = parse_gates(ns.gates) if ns.gates is not None else [raw.get("gate", "softplus")]
    shapes = parse_shapes(ns.shapes or DEFAULT_SHAPES, flag="--shapes")
    import torch

    no_gpu = ("kdagen tune times kernels on this machine's GPU and there is none "
              "(torch.cuda.is_available() is False); `kdagen build --compile-only` builds "
              "without one")
    try:
        target = device_target()  # KDAGEN_ARCH, else the GPU's
    except RuntimeError:
        if torch.cuda.is_available():
            raise  # a GPU kdagen has no target for
        raise RuntimeError(no_gpu) from None
    from .spec import KernelSpec

    source = ns.spec or "spec"
    for gate in gates:  # refuse a bad gate, width or chunk size before anything is timed
        for w in widths or [None]:
            for c in chunks or [None]:
                KernelSpec.parse(raw | {"target": target, "gate": gate}
                                 | ({"block_width": w} if w else {}) | ({"chunk_size": c} if c else {}),
                                 source=source)
    if not torch.cuda.is_available():
        raise RuntimeError(no_gpu)
    for gate in gates:
        for n, t, h in shapes:
            fields = raw | {"target": target, "gate": gate}
            if chunks:
                kerns = [kdagen.load(fields | {"chunk_size": c}) for c in chunks]
                autotune.tune_chunk_size(kerns, n, h, t, reps=ns.reps)
                continue
            chunks_per_seq = -(-t // KernelSpec.parse(fields, source=source).chunk_size)
            if widths:
                kerns = [kdagen.load(fields | {"block_width": w}) for w in widths]
                autotune.tune_block_width(kerns, n, h, chunks_per_seq, reps=ns.reps)
            else:
                autotune.tune_groups(kdagen.load(fields), n, h, chunks_per_seq, reps=ns.reps)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdagen",
        description="kdagen: a kernel compiler for Kimi Delta Attention. Specs go through "
                    "Jinja templates to HIP kernels, ninja builds them, torch loads them.",
        epilog="environment: KDAGEN_CACHE_DIR (build cache, default ~/.cache/kdagen), "
               "KDAGEN_ARCH (default --arch list), KDAGEN_REBUILD=1 (rebuild), KDAGEN_VERBOSE=1 "
               "(compiler lines), KDAGEN_JOBS (ninja -j), KDAGEN_GROUPS (force a chunk-group "
               "count), KDAGEN_SEGMENTS (force pass one's segments), KDAGEN_AUTOTUNE=1 (tune unseen shapes on first use; off: ignore the "
               "autotune cache), KDAGEN_CHECK_VALUES=0 (skip host-side value checks), "
               "KDAGEN_BENCH_GRAPH=0 (bench: no CUDA-graph column)",
    )
    p.add_argument("--version", action="version", version=f"kdagen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-v", "--verbose", action="store_true", help="show the compiler lines")
        sp.add_argument("--force", action="store_true", help="rebuild even if cached")
        sp.add_argument("--report", action="store_true",
                        help="after the build, print each kernel's registers, spill / scratch bytes "
                             "and static shared memory (cuobjdump; llvm-readelf on AMD); spills flagged")

    b = sub.add_parser("build", help="render and build a spec, print its artefacts",
                       description="Render and build one spec. " + DEFAULT_SPEC_NOTE)
    b.add_argument("spec", nargs="?", help="spec YAML (default: the default spec)")
    b.add_argument("--arch", action="append", help="target(s), comma separated or repeated; "
                   "overrides the spec's target (e.g. --arch gfx90a,gfx942,sm_90)")
    b.add_argument("--compile-only", action="store_true",
                   help="compile device code to objects only: no torch binding, no link, no load "
                        "(works without a GPU)")
    common(b)
    b.set_defaults(fn=cmd_build)

    r = sub.add_parser("render", help="write a spec's generated sources",
                       description="Render a spec's sources into DIR/<variant>-<hash>/. "
                                   + DEFAULT_SPEC_NOTE)
    r.add_argument("spec", nargs="?", help="spec YAML (default: the default spec)")
    r.add_argument("-o", "--output", required=True, help="output folder")
    r.add_argument("--arch", action="append", help="target(s) to render for")
    r.set_defaults(fn=cmd_render)

    v = sub.add_parser("variants", help="expand a grid of specs and build them all in parallel",
                       description="Expand GRID.yaml (base, grid, filter) into specs, prune the ones "
                                   "the validator refuses (with reasons), build the rest through "
                                   "one ninja graph.")
    v.add_argument("grid", help="grid YAML")
    v.add_argument("--filter", help="fnmatch pattern on variant names, e.g. '*_bf16_*'")
    v.add_argument("--list", action="store_true", help="list the variants, build nothing")
    v.add_argument("--compile-only", action="store_true", help="device objects only (no GPU needed)")
    v.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (ninja -j)")
    common(v)
    v.set_defaults(fn=cmd_variants)

    g = sub.add_parser("generated", help="re-render generated/ from examples/shipped.yaml",
                       description="Re-render the shipped variants into generated/, or --check "
                                   "that it is current.")
    g.add_argument("--check", action="store_true", help="fail if generated/ is stale")
    g.set_defaults(fn=cmd_generated)

    t = sub.add_parser("targets", help="list the known targets")
    t.set_defaults(fn=cmd_targets)

    c = sub.add_parser("cache", help="list or clear the build cache")
    c.add_argument("action", choices=["list", "clear"])
    c.set_defaults(fn=cmd_cache)

    bn = sub.add_parser("bench", help="time kdagen against fla.ops.kda.chunk_kda on this GPU",
                        description="Side-by-side prefill benchmark (needs a GPU and fla-core).")
    bn.add_argument("--shapes", help="comma separated NxT:H list, e.g. 1x32768:32,8x4096:32")
    bn.add_argument("--reps", type=int, default=50, help="timed repetitions per shape")
    bn.add_argument("--gates", help="gate forms to time, comma separated (default lower_bound,softplus)")
    bn.add_argument("--chunk-size", default="auto", choices=["auto", "16", "32", "64"],
                    help="kdagen's chunk size: auto (default) takes the one `kdagen tune "
                         "--chunk-sizes` recorded for each shape, else 64 (FLA's)")
    bn.add_argument("--markdown", help="write the result table to this markdown file")
    bn.add_argument("--plot", help="write a PNG plot here")
    bn.add_argument("--json", help="write raw results here")
    bn.add_argument("--merge", metavar="A.json,B.json",
                    help="time nothing: join the --json files of earlier runs (one commit and GPU, "
                         "e.g. one gate per device call) into one table, JSON and plot")
    bn.set_defaults(fn=cmd_bench)

    tu = sub.add_parser("tune", help="measure chunk-group counts (and block widths or chunk "
                                     "sizes) per shape, for this GPU's autotune cache",
                        description="Time the chunk scan for every candidate group count on "
                                    "synthetic inputs of each shape and record the fastest in "
                                    "<cache>/tune/<device>.json, which fused_kda_chunk and "
                                    "kda_forward use at run time; with --block-widths or "
                                    "--chunk-sizes also time each variant end to end and record "
                                    "the fastest (kda_forward and kdagen bench use it). "
                                    + DEFAULT_SPEC_NOTE)
    tu.add_argument("spec", nargs="?", help="spec YAML (default: the default spec)")
    tu.add_argument("--shapes", help="comma separated NxT:H list (default: the bench shapes)")
    tu.add_argument("--block-widths", help="also pick the fastest of these block widths, e.g. "
                                           "32,64,128 (builds each variant)")
    tu.add_argument("--chunk-sizes", help="instead pick the fastest of these chunk sizes end to "
                                          "end, e.g. 16,32,64 (builds each variant; kda_forward and "
                                          "kdagen bench use the choice)")
    tu.add_argument("--gates", help="gate forms, comma separated (default: the spec's)")
    tu.add_argument("--reps", type=int, default=10, help="timed repetitions per candidate")
    tu.add_argument("--show", action="store_true", help="print this GPU's recorded choices")
    tu.set_defaults(fn=cmd_tune)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    from .build import BuildError
    from jinja2 import TemplateError, TemplateSyntaxError

    from .spec import SpecError
    from .toolchain import ToolchainError

    try:
        return ns.fn(ns)
    except (SpecError, BuildError, ToolchainError, RuntimeError, OSError, ValueError) as e:
        print(f"kdagen: error: {e}", file=sys.stderr)
        return 1
    except TemplateSyntaxError as e:  # a broken template: its file and line, no traceback
        print(f"kdagen: error: template {e.filename or e.name}:{e.lineno}: {e.message}", file=sys.stderr)
        return 1
    except TemplateError as e:
        print(f"kdagen: error: rendering a template: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kdagen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
