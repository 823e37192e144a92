"""Grid expansion (kdagen.variants) and the command line (kdagen.cli), CPU only: no
command here builds or compiles anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdagen.cli import main
from kdagen.render import BINDING_SOURCE, KERNEL_SOURCE, render
from kdagen.spec import KernelSpec, SpecError
from kdagen.targets import TARGETS
from kdagen.variants import expand, expand_file

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(autouse=True)
def _no_env_arch(monkeypatch):
    monkeypatch.delenv("KDAGEN_ARCH", raising=False)


def names(exp) -> list[str]:
    return [s.name for s in exp.specs]


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- expansion ----------------------------------------------------------------------


def test_product_in_order():
    e = expand({"grid": {"head_dim": [64, 128], "io_dtype": ["bf16", "fp16"]}})
    assert names(e) == [
        "kda_d64_c64_bv64_bf16_sm90",
        "kda_d64_c64_bv64_fp16_sm90",
        "kda_d128_c64_bv128_bf16_sm90",
        "kda_d128_c64_bv128_fp16_sm90",
    ]
    assert e.pruned == []


def test_base_applies_and_grid_overrides_base():
    e = expand({"base": {"chunk_size": 32, "target": "gfx942"},
                "grid": {"target": ["gfx90a", "sm_90"], "gate": ["lower_bound"]}})
    assert names(e) == ["kda_d128_c32_bv128_bf16_lb_gfx90a", "kda_d128_c32_bv128_bf16_lb_sm90"]


def test_base_only_is_one_variant():
    assert names(expand({"base": {"head_dim": 64}})) == ["kda_d64_c64_bv64_bf16_sm90"]


def test_pruning_with_reasons():
    e = expand({"base": {"chunk_size": 64},
                "grid": {"head_dim": [128, 256], "target": ["gfx942", "sm_90"]}})
    assert names(e) == ["kda_d128_c64_bv128_bf16_gfx942", "kda_d128_c64_bv128_bf16_sm90"]
    assert len(e.pruned) == 2
    (f1, why1), (f2, why2) = e.pruned
    assert f1 == {"chunk_size": 64, "head_dim": 256, "target": "gfx942"}
    assert why1 == ("chunk_size = 64, head_dim = 256: the prologue needs 101120 bytes of shared "
                    "memory, gfx942 has 65536; use a smaller chunk_size")
    assert f2 == {"chunk_size": 64, "head_dim": 256, "target": "sm_90"}
    assert why2.startswith("head_dim = 256 on sm_90: the chunk scan would keep 128 fp32 state values")
    assert "invalid spec" not in why1 + why2


def test_pruning_of_field_errors_keeps_the_field_name():
    e = expand({"grid": {"head_dim": [96, 128], "target": ["sm_90", "gfx1100"]}})
    assert names(e) == ["kda_d128_c64_bv128_bf16_sm90"]
    reasons = [why for _, why in e.pruned]
    assert len(reasons) == 3
    assert any("field 'head_dim' = 96" in r for r in reasons)
    assert any("unknown target 'gfx1100'" in r for r in reasons)


def test_filter_in_file_and_argument():
    g = {"grid": {"gate": ["softplus", "lower_bound"], "target": ["gfx942", "sm_90"]},
         "filter": "*_lb_*"}
    assert names(expand(g)) == ["kda_d128_c64_bv128_bf16_lb_gfx942", "kda_d128_c64_bv128_bf16_lb_sm90"]
    # the argument wins over the file's filter
    assert names(expand(g, pattern="*_gfx942")) == ["kda_d128_c64_bv128_bf16_gfx942",
                                                    "kda_d128_c64_bv128_bf16_lb_gfx942"]
    assert names(expand(g, pattern="*_gfx90a")) == []
    # filtered variants are not "pruned"
    assert expand(g).pruned == []


def test_dedup_within_a_grid():
    e = expand({"grid": {"ops": [["recurrent"], ["recurrent", "recurrent"]],
                         "block_width": [None, 128], "head_dim": [128, 128]}})
    assert names(e) == ["kda_d128_c64_bv128_bf16_ops_rec_sm90"]


def test_grids_union_dedups_in_first_seen_order():
    e = expand({"grids": [
        {"grid": {"target": ["sm_90", "gfx942"]}},
        {"grid": {"target": ["gfx942", "gfx90a"]}},
        {"base": {"gate": "lower_bound"}, "grid": {"head_dim": [256]}, "filter": "*"},
    ]})
    assert names(e) == ["kda_d128_c64_bv128_bf16_sm90", "kda_d128_c64_bv128_bf16_gfx942",
                        "kda_d128_c64_bv128_bf16_gfx90a"]
    assert len(e.pruned) == 1  # d256 chunk scan on sm_90
    assert "head_dim = 256 on sm_90" in e.pruned[0][1]


def test_grids_filter_applies_to_every_grid():
    e = expand({"grids": [{"grid": {"target": ["sm_90", "gfx942"]}},
                          {"grid": {"gate": ["lower_bound"], "target": ["gfx90a", "sm_90"]}}],
                "filter": "*_sm90"})
    assert names(e) == ["kda_d128_c64_bv128_bf16_sm90", "kda_d128_c64_bv128_bf16_lb_sm90"]


def test_example_grids():
    e = expand_file(EXAMPLES / "grid.yaml")
    # 3 head dims x 2 dtypes x 2 gates x 3 targets, less head_dim 256 everywhere (LDS on the
    # two 64 KiB AMD targets, registers on sm_90)
    assert len(e.specs) == 24 and len(e.pruned) == 12
    assert all(f["head_dim"] == 256 for f, _ in e.pruned)
    assert len({s.uri for s in e.specs}) == 24
    gpu = expand_file(EXAMPLES / "gpu_grid.yaml")
    assert len(gpu.specs) == 25 and gpu.pruned == []  # with c32 / c16 at bv128 (the bench's sizes)
    bench_grid = {s.uri for s in expand_file(EXAMPLES / "bench_grid.yaml").specs}
    assert len(bench_grid) == 6 and bench_grid <= {s.uri for s in gpu.specs}  # gpu_check.sh bench
    assert [s.uri for s in expand_file(EXAMPLES / "shipped.yaml").specs] == [
        "kda_d128_c64_bv128_bf16_gfx942-e3b20d6c", "kda_d128_c64_bv128_bf16_sm90-8142fdc5",
        "kda_d128_c64_bv128_bf16_lb_gfx942-ebf04647", "kda_d128_c64_bv128_bf16_lb_sm90-8531df77",
    ]


def test_sanitize_grid_builds_what_sanitize_ops_loads():
    """`gpu_check.sh sanitize` builds examples/sanitize_grid.yaml and then runs
    scripts/sanitize_ops.py: the grid must hold every variant the script loads (on sm_90),
    else the sanitizer's run would compile the missing one under its time limit."""
    import ast

    tree = ast.parse((REPO / "scripts" / "sanitize_ops.py").read_text())
    loaded = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load" and isinstance(node.args[0], ast.Dict)):
            fields = {ast.literal_eval(k): (ast.literal_eval(v) if k.value != "target" else "sm_90")
                      for k, v in zip(node.args[0].keys, node.args[0].values)}
            loaded.add(KernelSpec.parse(fields).uri)
    assert len(loaded) == 5
    grid = {s.uri for s in expand_file(EXAMPLES / "sanitize_grid.yaml").specs}
    assert grid == loaded
    assert grid <= {s.uri for s in expand_file(EXAMPLES / "gpu_grid.yaml").specs}


@pytest.mark.parametrize("grid, expected", [
    ([{"grid": {}}], "a grid file is a mapping with 'grid'"),
    ("head_dim: 128", "a grid file is a mapping"),
    ({"grid": {"head_dim": [64]}, "axes": {}}, "unknown key(s) axes; a grid file has 'base', 'grid' and 'filter'"),
    ({"grid": {"head_dim": 128}}, "grid field 'head_dim' must be a non-empty list, got 128"),
    ({"grid": {"head_dim": []}}, "grid field 'head_dim' must be a non-empty list, got []"),
    ({"base": "chunk_size: 64", "grid": {}}, "'base' and 'grid' must be mappings"),
    ({"grid": [["head_dim", 64]]}, "'base' and 'grid' must be mappings"),
    ({"grids": {"a": {}}}, "'grids' must be a list of grids"),
    ({"grids": [], "base": {}}, "'grids' must be a list of grids (and only 'filter' beside it)"),
    ({"grids": [{"grid": {}}, 7]}, "grid: grids[1]: a grid file is a mapping"),
    ({"grids": [{"grid": {"head_dim": 64}}]}, "grid: grids[0]: grid field 'head_dim' must be"),
])
def test_bad_grids(grid, expected):
    with pytest.raises(SpecError) as exc:
        expand(grid)
    assert expected in str(exc.value)
    assert str(exc.value).startswith("grid: ")


@pytest.mark.parametrize("grid, expected", [
    ({"grid": {"headdim": [64]}}, "grid field(s) 'headdim' are not spec fields"),
    ({"base": {"chunksize": 16}, "grid": {"head_dim": [64]}}, "base field(s) 'chunksize' are not spec fields"),
    ({"grids": [{"grid": {"head_dim": [64]}}, {"grid": {"headdim": [128]}}]},
     "grids[1]: grid field(s) 'headdim' are not spec fields"),
    ({}, "a grid file needs 'grid'"),
    ({"grid": None}, "'base' and 'grid' must be mappings"),
    ({"base": None}, "'base' and 'grid' must be mappings"),
])
def test_a_misspelled_field_or_an_empty_grid_is_an_error_not_a_pruning(grid, expected):
    with pytest.raises(SpecError) as exc:
        expand(grid)
    assert expected in str(exc.value)


def test_a_sub_grids_own_filter_stands_beside_the_top_level_one():
    g = {"grids": [{"grid": {"head_dim": [64, 128]}, "filter": "*_d64_*"},
                   {"grid": {"head_dim": [64, 128], "gate": ["lower_bound"]}}],
         "filter": "*_sm90"}
    assert names(expand(g)) == ["kda_d64_c64_bv64_bf16_sm90", "kda_d64_c64_bv64_bf16_lb_sm90",
                                "kda_d128_c64_bv128_bf16_lb_sm90"]
    # the command line's pattern replaces the top-level filter, not the sub-grid's
    assert names(expand(g, pattern="*_lb_*")) == ["kda_d64_c64_bv64_bf16_lb_sm90",
                                                  "kda_d128_c64_bv128_bf16_lb_sm90"]


def test_an_empty_grid_file_is_an_error(tmp_path):
    p = write(tmp_path, "g.yaml", "# nothing\n")
    with pytest.raises(SpecError, match=f"^{re.escape(str(p))}: a grid file needs 'grid'"):
        expand_file(p)


def test_bad_grid_file_names_the_file(tmp_path):
    p = write(tmp_path, "g.yaml", "grid:\n  head_dim: 128\n")
    with pytest.raises(SpecError) as exc:
        expand_file(p)
    assert str(exc.value) == f"{p}: grid field 'head_dim' must be a non-empty list, got 128"
    p = write(tmp_path, "m.yaml", "grid:\n  head_dim: [64, 128\n")
    with pytest.raises(SpecError) as exc:
        expand_file(p)
    assert str(exc.value).startswith(f"{p}: line 3, column ")
    with pytest.raises(SpecError, match="cannot read"):
        expand_file(tmp_path / "missing.yaml")


@pytest.mark.parametrize("grid", [
    {"grid": {"head_dim": [64]}, "filter": 5},
    {"grid": {"head_dim": [64]}, "filter": ["*_bf16_*"]},
    {"grids": [{"grid": {"head_dim": [64]}}], "filter": 5},
], ids=["int", "list", "grids-int"])
def test_non_string_filter_is_a_spec_error(grid):
    with pytest.raises(SpecError, match="filter"):
        expand(grid)


# ---- CLI ----------------------------------------------------------------------------


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_paragraph_error(err: str, *needles: str):
    assert "Traceback" not in err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, f"error is not one line/paragraph: {err!r}"
    assert lines[0].startswith("kdagen: error: "), err
    for n in needles:
        assert n in lines[0], (n, err)


def test_targets(capsys):
    rc, out, err = run_cli(capsys, "targets")
    assert rc == 0 and err == ""
    lines = out.strip().split("\n")
    assert lines[0].split()[:5] == ["target", "vendor", "arch", "wave", "LDS/smem"]
    assert len(lines) == 1 + len(TARGETS)
    for line, t in zip(lines[1:], TARGETS.values()):
        assert line.split()[:6] == [t.name, t.vendor, t.arch, str(t.wave_size), str(t.shared_mem),
                                    t.matrix]
        assert line.endswith(t.description)


def test_render_writes_files(capsys, tmp_path):
    spec_file = write(tmp_path, "s.yaml", "head_dim: 64\ngate: lower_bound\ntarget: gfx942\n")
    out_dir = tmp_path / "out"
    rc, out, err = run_cli(capsys, "render", str(spec_file), "-o", str(out_dir))
    assert rc == 0, err
    spec = KernelSpec.from_yaml(spec_file)
    folder = out_dir / spec.uri
    assert out.strip() == str(folder)
    files = render(spec).files
    written = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert written == sorted(files)
    assert (folder / KERNEL_SOURCE).read_text() == files[KERNEL_SOURCE]
    assert "static constexpr int kHeadDim = 64;" in (folder / KERNEL_SOURCE).read_text()
    assert '#include "kdagen/vendor_cdna.h"' in (folder / KERNEL_SOURCE).read_text()
    assert (folder / BINDING_SOURCE).is_file()


def test_render_default_spec_and_arch_list(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "render", "-o", str(tmp_path), "--arch", "gfx90a,gfx942",
                           "--arch", "sm_90")
    assert rc == 0, err
    base = KernelSpec.parse({})
    expected = [tmp_path / base.with_target(a).uri for a in ("gfx90a", "gfx942", "sm_90")]
    assert out.split() == [str(p) for p in expected]
    assert all((p / KERNEL_SOURCE).is_file() for p in expected)


def test_render_honours_kdagen_arch(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KDAGEN_ARCH", "gfx950")
    rc, out, _ = run_cli(capsys, "render", "-o", str(tmp_path))
    assert rc == 0
    assert out.strip() == str(tmp_path / KernelSpec.parse({"target": "gfx950"}).uri)


def test_variants_list(capsys):
    rc, out, err = run_cli(capsys, "variants", str(EXAMPLES / "grid.yaml"), "--list")
    assert rc == 0
    assert out.split() == [s.uri for s in expand_file(EXAMPLES / "grid.yaml").specs]
    pruned = [line for line in err.splitlines() if line.startswith("pruned ")]
    assert len(pruned) == 12
    assert "the prologue needs 101120 bytes" in err


def test_variants_list_filter(capsys):
    rc, out, _ = run_cli(capsys, "variants", str(EXAMPLES / "shipped.yaml"), "--list",
                         "--filter", "*_lb_*")
    assert rc == 0
    assert out.split() == ["kda_d128_c64_bv128_bf16_lb_gfx942-ebf04647",
                           "kda_d128_c64_bv128_bf16_lb_sm90-8531df77"]


@pytest.mark.parametrize("cmd", [["build"], ["variants", str(EXAMPLES / "shipped.yaml")]])
def test_compile_only_says_nothing_was_linked(capsys, monkeypatch, cmd):
    """`build` and `variants` with --compile-only print the objects and say on stderr
    that nothing was linked or loaded (the build itself is stubbed: nothing compiles)."""
    import kdagen.build

    class Entry:
        def artefacts(self):
            return ["/cache/x/obj/kernels.o"]

    monkeypatch.setattr(kdagen.build, "build_many", lambda specs, mode, **kw: [Entry()] * len(specs))
    rc, out, err = run_cli(capsys, *cmd, "--compile-only")
    assert rc == 0 and "/cache/x/obj/kernels.o" in out
    assert "nothing was linked or loaded" in err


def test_variants_nothing_left(capsys):
    rc, out, err = run_cli(capsys, "variants", str(EXAMPLES / "shipped.yaml"), "--list",
                           "--filter", "*_gfx90a")
    assert rc == 1 and out == ""
    assert_one_paragraph_error(err, "no variant is left after pruning and filtering")


def test_generated_check(capsys):
    rc, out, err = run_cli(capsys, "generated", "--check")
    assert rc == 0, err
    assert out.strip() == "generated/ is up to date"


@pytest.mark.parametrize("cmd", ["build", "render", "variants", "generated", "targets", "cache",
                                 "bench"])
def test_subcommand_help(capsys, cmd):
    with pytest.raises(SystemExit) as exc:
        main([cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kdagen {cmd}")


def test_top_level_help_and_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("build", "render", "variants", "generated", "targets", "cache", "bench"):
        assert cmd in out
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == "kdagen 0.1.0"


def test_malformed_yaml(capsys, tmp_path):
    p = write(tmp_path, "bad.yaml", "head_dim: 128\nchunk_size: [64\n")
    rc, out, err = run_cli(capsys, "render", str(p), "-o", str(tmp_path / "o"))
    assert rc == 1 and out == ""
    assert_one_paragraph_error(err, str(p), "line 3", "malformed YAML")
    assert not (tmp_path / "o").exists()


def test_unknown_arch(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "render", "-o", str(tmp_path), "--arch", "sm_90,gfx1100")
    assert rc == 1 and out == ""
    assert_one_paragraph_error(err, "--arch gfx1100", "unknown target 'gfx1100'",
                               "known targets: gfx90a, gfx942, gfx950, sm_90")
    assert list(tmp_path.iterdir()) == []  # nothing rendered before the refusal


def test_arch_makes_spec_impossible(capsys, tmp_path):
    p = write(tmp_path, "s.yaml", "head_dim: 256\ntarget: gfx950\n")
    rc, _, err = run_cli(capsys, "render", str(p), "-o", str(tmp_path / "o"), "--arch", "gfx942")
    assert rc == 1
    assert_one_paragraph_error(err, "--arch gfx942", "101120 bytes of shared memory")


@pytest.mark.parametrize("from_env", [False, True])
def test_arch_replaces_the_files_target_before_validation(capsys, tmp_path, monkeypatch, from_env):
    """A file that names no target (sm_90 by default, where head dim 256 has no chunk scan)
    is judged on the target it is rendered for; a refusal names where the target came from."""
    p = write(tmp_path, "s.yaml", "head_dim: 256\n")
    arch = ["--arch", "gfx950"] if not from_env else []
    if from_env:
        monkeypatch.setenv("KDAGEN_ARCH", "gfx950")
    rc, out, err = run_cli(capsys, "render", str(p), "-o", str(tmp_path / "o"), *arch)
    assert rc == 0, err
    assert out.strip() == str(tmp_path / "o" / KernelSpec.parse({"head_dim": 256, "target": "gfx950"}).uri)
    if from_env:
        monkeypatch.setenv("KDAGEN_ARCH", "sm_90")
    rc, _, err = run_cli(capsys, "render", str(p), "-o", str(tmp_path / "o2"),
                         *(["--arch", "sm_90"] if not from_env else []))
    assert rc == 1
    assert_one_paragraph_error(err, "KDAGEN_ARCH sm_90" if from_env else "--arch sm_90",
                               "head_dim = 256 on sm_90")


def test_an_arch_that_names_no_target_is_an_error(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "render", "-o", str(tmp_path), "--arch", " , ")
    assert rc == 1 and out == ""
    assert_one_paragraph_error(err, "names no target")


def test_impossible_spec(capsys, tmp_path):
    p = write(tmp_path, "s.yaml", "head_dim: 256\nchunk_size: 64\ntarget: sm_90\n")
    rc, out, err = run_cli(capsys, "render", str(p), "-o", str(tmp_path / "o"))
    assert rc == 1 and out == ""
    assert_one_paragraph_error(err, str(p), "head_dim = 256 on sm_90", "build ops: [recurrent]")


def test_unknown_field_and_bad_value(capsys, tmp_path):
    p = write(tmp_path, "s.yaml", "head_dim: 96\nblock: 64\n")
    rc, _, err = run_cli(capsys, "render", str(p), "-o", str(tmp_path / "o"))
    assert rc == 1
    assert_one_paragraph_error(err, "field 'head_dim' = 96", "unknown field 'block'")


def test_missing_spec_file(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "render", str(tmp_path / "nope.yaml"), "-o", str(tmp_path))
    assert rc == 1
    assert_one_paragraph_error(err, "nope.yaml: cannot read: No such file or directory")


def test_bad_grid_file(capsys, tmp_path):
    p = write(tmp_path, "g.yaml", "grids:\n  grid: {}\n")
    rc, _, err = run_cli(capsys, "variants", str(p), "--list")
    assert rc == 1
    assert_one_paragraph_error(err, str(p), "'grids' must be a list of grids")


def test_yaml_constructor_error_is_an_error_line(capsys, tmp_path):
    p = write(tmp_path, "s.yaml", "head_dim: !!bool maybe\n")
    rc, _, err = run_cli(capsys, "render", str(p), "-o", str(tmp_path / "o"))
    assert rc == 1
    assert_one_paragraph_error(err, str(p))


def test_non_string_filter_is_an_error_line(capsys, tmp_path):
    p = write(tmp_path, "g.yaml", "grid: {head_dim: [64]}\nfilter: 5\n")
    rc, _, err = run_cli(capsys, "variants", str(p), "--list")
    assert rc == 1
    assert_one_paragraph_error(err, "filter")


def _run_module(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KDAGEN_ARCH", None)
    return subprocess.run([sys.executable, "-m", "kdagen.cli", *argv], capture_output=True,
                          text=True, env=env, cwd=str(cwd), timeout=120)


def test_build_nonexistent_in_a_subprocess(tmp_path):
    r = _run_module("build", "nonexistent.yaml", cwd=tmp_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip() == "kdagen: error: nonexistent.yaml: cannot read: No such file or directory"
    assert r.stdout == ""


def test_usage_error_in_a_subprocess(tmp_path):
    r = _run_module("render", cwd=tmp_path)  # -o is required
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "the following arguments are required: -o/--output" in r.stderr
