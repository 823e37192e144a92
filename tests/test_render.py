"""Rendering: deterministic, strict, the spec's constants and vendor layer, ops subsets,
and the committed generated/ folder being current. No compiler is run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from kdagen import resources
from kdagen.generated import GENERATED, check_generated, shipped_specs
from kdagen.render import (
    BINDING_SOURCE, KERNEL_SOURCE, _env, header_files, render, symbol_prefix, templates_digest,
    templates_dir,
)
from kdagen.spec import KernelSpec

REPO = Path(__file__).resolve().parent.parent

SPECS = {
    "default": {},
    "gfx942_lb_conv4": {"target": "gfx942", "gate": "lower_bound", "conv_width": 4},
    "d64_c32_fp16_gfx90a": {"head_dim": 64, "chunk_size": 32, "block_width": 32, "io_dtype": "fp16",
                            "target": "gfx90a"},
    "rec_fp32_d256": {"head_dim": 256, "io_dtype": "fp32", "ops": ["recurrent"]},
    "pro_chu_gfx950": {"head_dim": 256, "ops": ["prologue", "chunk"], "target": "gfx950"},
}


def files_digest(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def kernels(fields) -> str:
    return render(KernelSpec.parse(fields)).files[KERNEL_SOURCE]


def binding(fields) -> str:
    return render(KernelSpec.parse(fields)).files[BINDING_SOURCE]


# ---- determinism --------------------------------------------------------------------


@pytest.mark.parametrize("key", list(SPECS))
def test_render_twice_is_identical(key):
    spec = KernelSpec.parse(SPECS[key])
    a, b = render(spec), render(spec)
    assert a.files == b.files
    assert a.spec == spec
    # an equivalent spec written differently renders the same bytes
    assert render(KernelSpec.parse(spec.canonical())).files == a.files


def test_render_identical_in_a_fresh_process():
    code = (
        "import hashlib, json, sys\n"
        "from kdagen.spec import KernelSpec\n"
        "from kdagen.render import render\n"
        "out = {}\n"
        "for k, d in json.loads(sys.argv[1]).items():\n"
        "    f = render(KernelSpec.parse(d)).files\n"
        "    out[k] = hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONHASHSEED="777")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(SPECS)], capture_output=True,
                         text=True, env=env, cwd=str(REPO), timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = json.loads(out.stdout)
    ours = {k: files_digest(render(KernelSpec.parse(d)).files) for k, d in SPECS.items()}
    assert theirs == ours
    assert len(set(ours.values())) == len(ours)  # different specs, different sources


def test_templates_digest_stable_and_covers_templates():
    d = templates_digest()
    assert re.fullmatch(r"[0-9a-f]{64}", d)
    assert templates_digest() == d
    root = templates_dir()
    assert (root / "kernels.hip.j2").is_file() and (root / "binding.cpp.j2").is_file()


# ---- StrictUndefined ----------------------------------------------------------------


def test_env_is_strict():
    env = _env(str(templates_dir()))
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError, match="missing_variable"):
        env.from_string("x = {{ missing_variable }};").render()
    # attribute of a defined object
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ spec.no_such_field }}").render(spec=KernelSpec.parse({}))
    assert env.from_string("x = {{ y }};").render(y=3) == "x = 3;"


def test_tiny_template_from_a_loader_with_the_same_settings(tmp_path):
    (tmp_path / "t.j2").write_text("static constexpr int kX = {{ x }};\n")
    env = _env(str(templates_dir())).overlay(loader=jinja2.FileSystemLoader(str(tmp_path)))
    assert env.get_template("t.j2").render(x=5) == "static constexpr int kX = 5;\n"
    with pytest.raises(jinja2.UndefinedError, match="'x' is undefined"):
        env.get_template("t.j2").render()


@pytest.mark.parametrize("template", ["kernels.hip.j2", "binding.cpp.j2"])
def test_real_templates_refuse_an_incomplete_context(template):
    env = _env(str(templates_dir()))
    spec = KernelSpec.parse({})
    with pytest.raises(jinja2.UndefinedError):
        env.get_template(template).render(spec=spec, spec_items=sorted(spec.canonical().items()))


# ---- content ------------------------------------------------------------------------


def constexprs(text: str) -> dict[str, str]:
    return dict(re.findall(r"static constexpr (?:int|bool|DType) (\w+) = ([^;]+);", text))


def test_default_constexprs():
    c = constexprs(kernels({}))
    assert c == {
        "kHeadDim": "128",
        "kChunk": "64",
        "kBlockV": "128",
        "kIo": "DType::kBF16",
        "kLowerBound": "false",
        "kConvWidth": "0",
        "kStageQ": "true",  # sm_90's shared memory holds the q rows too
        "kPlanar": "true",  # ... and the planar L / aqk operands
        "kPrologueBytes": str(resources.prologue_shared_mem(128, 64, "bf16", 232448)),
        "kPrologueSwizzle": "false",  # resources.PROLOGUE_SWIZZLE: off until timed
        "kChunkStages": "2",  # cp.async double buffering
        "kChunkStagesPassOne": "3",  # resources.PASS_ONE_STAGES: pass one buffers deeper
        "kChunkMinBlocks": "1",  # the c64 walk keeps its 255 registers
        "kStageUO": "true",
        "kChunkWgmma": "false",  # resources.CHUNK_WGMMA: per-wave mma.sync (measured faster)
        "kChunkUApart": "true",  # resources.CHUNK_U_APART: u = akk v beside -S w (measured faster)
        "kPassOnePaired": "false",  # resources.pass_one_paired: on (v21), but not at c64 on wave32 (spills)
        "kPassOneLead": str(resources.PASS_ONE_LEAD),  # pass one's segment 0 from X_0 (eighths of a segment)
        "kChunkSwizzle": "false",  # resources.CHUNK_SWIZZLE: on up to chunk 16 (CHUNK_SWIZZLE_MAX_CHUNK)
        "kChunkSwizzlePassOne": "false",  # resources.CHUNK_SWIZZLE_PASS_ONE: off (pass one padded)
        "kWalkPaired": "false",  # resources.walk_paired: on (v22), at chunk 16 only
        "kChunkWgUpdate": "false",  # resources.chunk_wg_update: on (v26), at chunk 16 only
        "kChunkWgUpdateOutputs": "false",  # resources.CHUNK_WG_UPDATE_OUTPUTS: pass one alone (session 27)
        "kPassOneWgVnew": "false",  # resources.PASS_ONE_WG_VNEW: timed slower (session 27)
        "kPad16": str(resources.PAD_16BIT),
        "kPadFp32": str(resources.PAD_FP32),
        "kRecurrentRows": str(resources.RECURRENT_ROWS_PER_BLOCK),
        "kRecurrentWaves": str(resources.RECURRENT_WAVES),
        "kPrologueThreads": str(resources.PROLOGUE_THREADS),
        "kPrologueMinBlocks": "2",  # 113 KB of LDS: two blocks per SM
        "kScanThreads": str(resources.SCAN_THREADS),
        "kScanTile": "16",  # 8 KB of fp32 R rows at D = 128
    }
    assert "static constexpr int kHeadDim = 128;" in kernels({})


@pytest.mark.parametrize("spec, threads, blocks", [
    (dict(chunk_size=32, block_width=64), 256, 4),   # 55 KB: four per SM, 64 registers
    (dict(chunk_size=16, block_width=64), 128, 8),   # 28 KB, half the threads: eight
    (dict(target="gfx90a", chunk_size=32, block_width=64), 256, 2),  # one fits the 64 KB: the old hint
    (dict(target="gfx90a", chunk_size=16, block_width=64), 128, 2),
])
def test_prologue_block_size_and_min_blocks_follow_its_lds(spec, threads, blocks):
    c = constexprs(kernels(spec))
    assert (c["kPrologueThreads"], c["kPrologueMinBlocks"]) == (str(threads), str(blocks))


def test_pass_one_stages_take_the_most_that_fit_up_to_the_constant(monkeypatch):
    """PASS_ONE_STAGES buffers the grouped walk's pass one deeper than the walk (its stage
    has no qg / aqk tiles), only as deep as its share of the LDS holds, never shallower."""
    assert constexprs(kernels({"chunk_size": 16}))["kChunkStagesPassOne"] == str(resources.PASS_ONE_STAGES)
    monkeypatch.setattr(resources, "PASS_ONE_STAGES", 4)
    c16 = resources.chunk_plan(128, 16, 128, "bf16", 32, 232448, True, 233472, 1024)
    assert (c16.stages, c16.stages_of_pass_one, c16.min_blocks) == (2, 4, 2)
    per_block = 233472 // 2 - 1024
    assert resources.pass_one_footprint(128, 16, 128, "bf16", 32, 4, True).shared_mem <= per_block
    assert constexprs(kernels({"chunk_size": 16}))["kChunkStagesPassOne"] == "4"
    monkeypatch.setattr(resources, "PASS_ONE_STAGES", 40)  # capped by the LDS share
    deep = resources.chunk_plan(128, 16, 128, "bf16", 32, 232448, True, 233472, 1024)
    st = deep.stages_of_pass_one
    assert resources.pass_one_footprint(128, 16, 128, "bf16", 32, st, True).shared_mem <= per_block
    assert resources.pass_one_footprint(128, 16, 128, "bf16", 32, st + 1, True).shared_mem > per_block
    monkeypatch.setattr(resources, "PASS_ONE_STAGES", 1)  # never below the walk's
    assert resources.chunk_plan(128, 16, 128, "bf16", 32, 232448, True, 233472, 1024).stages_of_pass_one == 2
    gfx = resources.chunk_plan(128, 64, 128, "bf16", 64, 65536, False)
    assert gfx.stages_of_pass_one == gfx.stages == 1  # no asynchronous copies: one stage


@pytest.mark.parametrize("target, stages, uo", [
    ("sm_90", "2", "true"),  # asynchronous copies, 227 KB: double-buffered, u / o staged
    ("gfx90a", "1", "false"),  # 64 KB: one stage, no room for the u / o tile
    ("gfx942", "1", "false"),
    ("gfx950", "1", "true"),  # 160 KB but no 16-byte async copies: one stage, u / o staged
])
def test_chunk_buffering_per_target(target, stages, uo):
    c = constexprs(kernels({"target": target}))
    assert (c["kChunkStages"], c["kStageUO"]) == (stages, uo)
    fp = resources.chunk_footprint(128, 64, 128, "bf16", 64 if target.startswith("gfx") else 32,
                                   int(stages), uo == "true")
    from kdagen.targets import get_target
    assert fp.shared_mem <= get_target(target).shared_mem


@pytest.mark.parametrize("spec, blocks", [
    (dict(chunk_size=16), 2),  # 256 lanes in 120-128 registers: two blocks per SM, capped there
    (dict(chunk_size=16, block_width=64), 2),
    (dict(chunk_size=32), 1),  # 160-200 registers: one
    (dict(chunk_size=64), 1),
    (dict(target="gfx90a", chunk_size=16), 1),  # wave64: the state alone is 32 VGPRs a row block
])
def test_chunk_scan_launch_bound(spec, blocks):
    assert constexprs(kernels(spec))["kChunkMinBlocks"] == str(blocks)


def test_chunk_plan_asks_for_two_blocks_only_where_their_lds_fits():
    stage2 = resources.chunk_footprint(128, 16, 128, "bf16", 32, 2, True).shared_mem
    fits = resources.chunk_plan(128, 16, 128, "bf16", 32, 232448, True, 2 * (stage2 + 1024), 1024)
    short = resources.chunk_plan(128, 16, 128, "bf16", 32, 232448, True, 2 * (stage2 + 1024) - 1, 1024)
    assert (fits.stages, fits.min_blocks) == (2, 2)
    assert (short.stages, short.min_blocks) == (2, 1)  # one block still takes both stages


@pytest.mark.parametrize("spec, on", [
    (dict(chunk_size=16), "true"),  # timed there (v26)
    (dict(chunk_size=16, gate="lower_bound", head_dim=64, block_width=64), "true"),
    (dict(), "false"),  # chunk 64: pass two spilled 8 bytes with it
    (dict(chunk_size=32), "false"),
    (dict(chunk_size=16, target="gfx90a"), "false"),  # CDNA: no warpgroup products
    (dict(chunk_size=16, target="gfx950"), "false"),
])
def test_warpgroup_state_update_at_chunk_16_on_hopper(spec, on):
    """resources.chunk_wg_update: the walks' state update per warpgroup only where it was
    timed (sm_90a, chunk 16); the template then takes it per walk, for blocks of whole
    warpgroups."""
    assert constexprs(kernels(spec))["kChunkWgUpdate"] == on


def test_warpgroup_state_update_in_pass_one_alone_by_default(monkeypatch):
    """resources.CHUNK_WG_UPDATE_OUTPUTS: the walks with outputs keep the per-wave update
    (H100, session 27) unless it is set, and only beside padded tiles (CHUNK_SWIZZLE off);
    pass one's update stays per warpgroup."""
    spec = dict(chunk_size=16)
    assert constexprs(kernels(spec))["kChunkWgUpdateOutputs"] == "false"
    monkeypatch.setattr(resources, "CHUNK_WG_UPDATE_OUTPUTS", True)
    assert constexprs(kernels(spec))["kChunkWgUpdateOutputs"] == "false"  # the shipped tiles swizzled
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", False)
    assert constexprs(kernels(spec))["kChunkWgUpdateOutputs"] == "true"
    monkeypatch.setattr(resources, "CHUNK_WG_UPDATE", False)
    assert constexprs(kernels(spec))["kChunkWgUpdateOutputs"] == "false"


@pytest.mark.parametrize("spec, wgmma", [
    # c64: three stages with the akk tile of the walk that forms u from v take 250 KB
    (dict(), "false"),
    (dict(chunk_size=16), "true"),
    (dict(head_dim=64, io_dtype="fp16"), "true"),  # one warpgroup of 64 rows
    (dict(chunk_size=32, block_width=64), "true"),
    (dict(block_width=32), "false"),  # not whole warpgroups: per-wave mma.sync
    (dict(block_width=16, head_dim=64, chunk_size=32), "false"),
    (dict(target="gfx90a"), "false"),  # CDNA: MFMA per wave
    (dict(target="gfx950", block_width=64), "false"),
])
def test_warpgroup_products_where_the_target_and_block_have_them(spec, wgmma, monkeypatch):
    monkeypatch.setattr(resources, "CHUNK_WGMMA", True)
    assert constexprs(kernels(spec))["kChunkWgmma"] == wgmma


def test_warpgroup_products_off_by_default():
    assert not resources.CHUNK_WGMMA
    assert constexprs(kernels(dict(chunk_size=16)))["kChunkWgmma"] == "false"


def test_paired_pass_one_on_by_default_and_never_with_warpgroup_products(monkeypatch):
    """PASS_ONE_PAIRED (on since session 17, timed faster) reaches the Config (and with it
    pass one's grid and launch bound) only where the walk takes the per-wave products and
    the pair's registers fit (resources.pass_one_paired: not at chunk 64 on wave32)."""
    assert resources.PASS_ONE_PAIRED
    assert constexprs(kernels(dict(chunk_size=16)))["kPassOnePaired"] == "true"
    assert constexprs(kernels(dict(chunk_size=32)))["kPassOnePaired"] == "true"
    assert constexprs(kernels(dict(chunk_size=64)))["kPassOnePaired"] == "false"  # wave32 c64 spills
    assert constexprs(kernels(dict(chunk_size=64, target="gfx942")))["kPassOnePaired"] == "true"
    monkeypatch.setattr(resources, "CHUNK_WGMMA", True)
    assert constexprs(kernels(dict(chunk_size=16)))["kPassOnePaired"] == "false"
    monkeypatch.setattr(resources, "PASS_ONE_PAIRED", False)
    monkeypatch.setattr(resources, "CHUNK_WGMMA", False)
    assert constexprs(kernels(dict(chunk_size=16)))["kPassOnePaired"] == "false"


def test_paired_walk_rows_only_at_chunk_16_on_wave32(monkeypatch):
    """WALK_PAIRED (on since v22, timed faster) reaches the Config only for chunk-16
    wave32 variants with blocks of whole 32-row pairs and the per-wave products; the
    walk's blocks then have half the threads."""
    paired = lambda spec: constexprs(kernels(spec))["kWalkPaired"]  # noqa: E731
    assert resources.WALK_PAIRED
    assert paired(dict(chunk_size=16)) == "true"
    assert paired(dict(chunk_size=16, block_width=32)) == "true"
    assert paired(dict(chunk_size=16, block_width=16)) == "false"
    assert paired(dict(chunk_size=32)) == "false"
    assert paired(dict(chunk_size=16, target="gfx90a")) == "false"
    assert not resources.walk_paired(16, 128, 32, wgmma=True)
    monkeypatch.setattr(resources, "WALK_PAIRED", False)
    assert paired(dict(chunk_size=16)) == "false"


def test_swizzled_tiles_per_vendor_and_chunk_never_with_warpgroup_products(monkeypatch):
    """The tile layout per vendor (resources.chunk_swizzle: CHUNK_SWIZZLE on NVIDIA up to
    CHUNK_SWIZZLE_MAX_CHUNK, the chunk it was timed at; CHUNK_SWIZZLE_CDNA, on, at every
    chunk) reaches the Config only for the per-wave walk, and its footprint drops the
    padding of every 16-bit tile (the u / o one too, which the warpgroup walk keeps)."""
    swz = lambda spec: constexprs(kernels(spec))["kChunkSwizzle"]  # noqa: E731
    assert resources.CHUNK_SWIZZLE and resources.CHUNK_SWIZZLE_CDNA
    assert resources.CHUNK_SWIZZLE_MAX_CHUNK == 16
    assert swz(dict(chunk_size=16)) == "true"
    assert swz(dict(chunk_size=32)) == "false" and swz(dict(chunk_size=64)) == "false"
    for t in ("gfx90a", "gfx942", "gfx950"):
        assert swz(dict(chunk_size=64, target=t)) == "true"
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_MAX_CHUNK", 64)
    assert swz(dict(chunk_size=64)) == "true"
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_CDNA", False)
    assert swz(dict(chunk_size=64, target="gfx942")) == "false"
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", False)
    assert swz(dict(chunk_size=16)) == "false"
    assert swz(dict(chunk_size=16, target="gfx942")) == "false"
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", True)
    fp = lambda **kw: resources.chunk_footprint(128, 16, 128, "bf16", 32, 2, True, **kw).shared_mem
    pad = resources.PAD_16BIT
    # w, qg, kg_t, aqk, u / o and akk: 2 stages, 2 bytes
    assert fp() - fp(swizzle=True) == 2 * 2 * (2 * 16 * pad + 128 * pad + 16 * pad + 16 * pad + 16 * pad)
    assert fp(wgmma=True, swizzle=True) == fp(wgmma=True)
    monkeypatch.setattr(resources, "CHUNK_WGMMA", True)
    assert swz(dict(chunk_size=16)) == "false"


def test_prologue_planes_swizzled_by_vendor_on_the_planar_path_only(monkeypatch):
    """PROLOGUE_SWIZZLE (NVIDIA) and PROLOGUE_SWIZZLE_CDNA, both off by default, reach the
    Config only for a planar prologue (resources.prologue_planar; CDNA's chunk-64 d128
    prologue is not one), and its LDS then drops the padding of its k and q planes."""
    cfg = lambda spec: constexprs(kernels(spec))  # noqa: E731
    assert not resources.PROLOGUE_SWIZZLE and not resources.PROLOGUE_SWIZZLE_CDNA
    for spec in (dict(chunk_size=16), dict(chunk_size=16, target="gfx942")):
        assert cfg(spec)["kPrologueSwizzle"] == "false"
    monkeypatch.setattr(resources, "PROLOGUE_SWIZZLE", True)
    pad = resources.PAD_16BIT
    for c in (16, 32, 64):
        c_on = cfg(dict(chunk_size=c))
        assert c_on["kPlanar"] == "true" and c_on["kPrologueSwizzle"] == "true"
        padded = resources.prologue_shared_mem(128, c, "bf16", 232448)
        assert int(c_on["kPrologueBytes"]) == padded - 2 * c * pad * 2
    assert cfg(dict(chunk_size=16, target="gfx942"))["kPrologueSwizzle"] == "false"
    monkeypatch.setattr(resources, "PROLOGUE_SWIZZLE_CDNA", True)
    assert cfg(dict(chunk_size=16, target="gfx942"))["kPrologueSwizzle"] == "true"
    c64 = cfg(dict(chunk_size=64, target="gfx942"))
    assert c64["kPlanar"] == "false" and c64["kPrologueSwizzle"] == "false"
    assert int(c64["kPrologueBytes"]) == resources.prologue_shared_mem(128, 64, "bf16", 65536)


def test_pass_one_tiles_swizzled_apart_from_the_walks_with_outputs(monkeypatch):
    """CHUNK_SWIZZLE_PASS_ONE (NVIDIA) sets pass one's tile layout apart from the single
    walk's and pass two's: None follows CHUNK_SWIZZLE. Pass one keeps its warpgroup state
    update only beside its own padded tiles, and its footprint follows its own layout; the
    walks with outputs lose the update (CHUNK_WG_UPDATE_OUTPUTS) where they swizzle. CDNA
    takes CHUNK_SWIZZLE_CDNA for both."""
    cfg = lambda spec: constexprs(kernels(spec))  # noqa: E731
    keys = ("kChunkSwizzle", "kChunkSwizzlePassOne", "kChunkWgUpdate", "kChunkWgUpdateOutputs")
    pick = lambda spec: tuple(cfg(spec)[k] for k in keys)  # noqa: E731
    assert resources.CHUNK_SWIZZLE and resources.CHUNK_SWIZZLE_PASS_ONE is False
    c16 = dict(chunk_size=16)
    assert pick(c16) == ("true", "false", "true", "false")  # the shipped chunk-16 layout
    assert pick(dict(chunk_size=32)) == ("false", "false", "false", "false")  # beyond the max chunk
    monkeypatch.setattr(resources, "CHUNK_WG_UPDATE_OUTPUTS", True)
    assert pick(c16) == ("true", "false", "true", "false")  # not beside swizzled tiles
    monkeypatch.setattr(resources, "CHUNK_WG_UPDATE_OUTPUTS", False)
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_PASS_ONE", None)
    assert pick(c16) == ("true", "true", "false", "false")  # None: pass one as the others
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE", False)
    assert pick(c16) == ("false", "false", "true", "false")
    monkeypatch.setattr(resources, "CHUNK_SWIZZLE_PASS_ONE", True)
    assert pick(c16) == ("false", "true", "false", "false")
    assert pick(dict(chunk_size=32))[1] == "false"  # pass one's switch keeps the max chunk too
    assert cfg(dict(chunk_size=64, target="gfx942"))["kChunkSwizzlePassOne"] == "true"  # CDNA: both
    t = KernelSpec.parse(c16).target_info
    plan = lambda one: resources.chunk_plan(128, 16, 128, "bf16", t.wave_size, t.shared_mem,  # noqa: E731
                                            t.async_copy, t.cu_smem, t.block_smem_reserve,
                                            t.warpgroup_mma, True, one)
    assert plan(None).pass_one_swizzle and not plan(False).pass_one_swizzle and plan(False).swizzle
    assert plan(False).wg_update and not plan(None).wg_update
    one = lambda swz: resources.pass_one_footprint(128, 16, 128, "bf16", 32, 3, True, swizzle=swz)  # noqa: E731
    assert one(True).shared_mem < one(False).shared_mem
    # each walk's LDS is planned with its own layout
    seen = {}
    for name in ("chunk_footprint", "pass_one_footprint"):
        real = getattr(resources, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.setdefault(_name, set()).add(a[8] if len(a) > 8 else kw.get("swizzle", False))
            return _real(*a, **kw)
        monkeypatch.setattr(resources, name, spy)
    plan(False)
    assert seen == {"chunk_footprint": {True}, "pass_one_footprint": {False}}


def test_warpgroup_tiles_drop_the_ldmatrix_padding():
    padded = resources.chunk_footprint(128, 16, 128, "bf16", 32, 2, True).shared_mem
    tiles = resources.chunk_footprint(128, 16, 128, "bf16", 32, 2, True, wgmma=True).shared_mem
    pad = resources.PAD_16BIT
    # w, qg, kg_t, aqk and akk: 2 stages, 2 bytes
    assert padded - tiles == 2 * 2 * (2 * 16 * pad + 128 * pad + 16 * pad + 16 * pad)
    assert resources.chunk_plan(128, 16, 128, "bf16", 32, 232448, True, warpgroup_mma=True).wgmma \
        == resources.CHUNK_WGMMA
    assert not resources.chunk_plan(128, 16, 128, "bf16", 32, 232448, False, warpgroup_mma=True).wgmma
    assert not resources.chunk_plan(128, 16, 32, "bf16", 32, 232448, True, warpgroup_mma=True).wgmma


def test_q_staging_follows_the_target_lds():
    assert constexprs(kernels({}))["kStageQ"] == "true"
    assert constexprs(kernels({"target": "gfx942"}))["kStageQ"] == "false"  # 64 KB LDS


@pytest.mark.parametrize("fields, planar", [
    ({}, "true"),  # sm_90: 227 KB
    ({"target": "gfx950"}, "true"),  # 160 KB
    ({"target": "gfx90a"}, "false"),  # 64 KB: 109 KB of planes do not fit at chunk 64 ...
    ({"target": "gfx90a", "chunk_size": 32}, "true"),  # ... they do at chunk 32
    ({"head_dim": 64}, "false"),  # L and its inverse do not fit in a d64 x c64 G plane
])
def test_planar_prologue_follows_the_target_lds(fields, planar):
    c = constexprs(kernels(fields))
    assert c["kPlanar"] == planar
    from kdagen.targets import get_target
    assert int(c["kPrologueBytes"]) <= get_target(fields.get("target", "sm_90")).shared_mem


def test_nondefault_constexprs():
    c = constexprs(kernels({"head_dim": 64, "chunk_size": 32, "block_width": 32, "io_dtype": "fp16",
                            "gate": "lower_bound", "conv_width": 3, "target": "gfx90a"}))
    assert (c["kHeadDim"], c["kChunk"], c["kBlockV"]) == ("64", "32", "32")
    assert c["kIo"] == "DType::kFP16"
    assert c["kLowerBound"] == "true"
    assert c["kConvWidth"] == "3"
    assert constexprs(kernels({"io_dtype": "fp32", "ops": ["recurrent"]}))["kIo"] == "DType::kFP32"


def test_spec_recorded_in_the_header_comment():
    spec = KernelSpec.parse(SPECS["gfx942_lb_conv4"])
    text = render(spec).files[KERNEL_SOURCE]
    for key, value in spec.canonical().items():
        assert f"//   {key}: {value}\n" in text
    assert f"// variant {spec.name}, target gfx942 (AMD Instinct MI300 (CDNA3))," in text
    assert "wave 64, matrix unit mfma." in text


@pytest.mark.parametrize("target, vendor, other", [
    ("sm_90", "vendor_cuda.h", "vendor_cdna.h"),
    ("gfx90a", "vendor_cdna.h", "vendor_cuda.h"),
    ("gfx942", "vendor_cdna.h", "vendor_cuda.h"),
    ("gfx950", "vendor_cdna.h", "vendor_cuda.h"),
])
def test_vendor_header(target, vendor, other):
    text = kernels({"target": target})
    assert f'#include "kdagen/{vendor}"' in text
    assert f'#include "kdagen/{other}"' not in text
    assert text.index('#include "kdagen/platform.h"') < text.index(f'#include "kdagen/{vendor}"')


def test_rendered_folder_is_self_contained():
    files = render(KernelSpec.parse({})).files
    headers = header_files()
    assert {"kdagen/chunk.h", "kdagen/prologue.h", "kdagen/recurrent.h", "kdagen/platform.h",
            "kdagen/vendor_cuda.h", "kdagen/vendor_cdna.h", "kdagen/launch_args.h"} <= set(headers)
    assert set(files) == {KERNEL_SOURCE, BINDING_SOURCE} | {f"include/{h}" for h in headers}
    root = templates_dir() / "include"
    for rel, text in headers.items():
        assert files[f"include/{rel}"] == (root / rel).read_text()
    # every quoted include of the rendered sources resolves inside the folder
    for src in (KERNEL_SOURCE, BINDING_SOURCE):
        for inc in re.findall(r'#include "([^"]+)"', files[src]):
            assert f"include/{inc}" in files, (src, inc)


def test_symbols_carry_the_variant_name():
    spec = KernelSpec.parse({"target": "gfx942", "gate": "lower_bound"})
    sym = symbol_prefix(spec)
    assert sym == "kdagen_kda_d128_c64_bv128_bf16_lb_gfx942"
    files = render(spec).files
    for op in ("recurrent", "prologue", "chunk"):
        assert f"int {sym}_{op}(const kdagen::" in files[KERNEL_SOURCE]
        assert f'm.def("{spec.name}_{op}(' in files[BINDING_SOURCE]
        assert f'm.impl("{spec.name}_{op}", &{op});' in files[BINDING_SOURCE]
    assert f"const char* {sym}_error_string(int code)" in files[KERNEL_SOURCE]


OPS_CASES = [["recurrent"], ["prologue"], ["chunk"], ["recurrent", "chunk"], ["prologue", "chunk"],
             ["recurrent", "prologue", "chunk"]]
STRUCTS = {"recurrent": "RecurrentArgs", "prologue": "PrologueArgs", "chunk": "ChunkArgs"}


@pytest.mark.parametrize("ops", OPS_CASES, ids=["+".join(o) for o in OPS_CASES])
def test_ops_subset_renders_only_those_ops(ops):
    spec = KernelSpec.parse({"ops": ops})
    sym, name = symbol_prefix(spec), spec.name
    files = render(spec).files
    k, b = files[KERNEL_SOURCE], files[BINDING_SOURCE]
    for op in ("recurrent", "prologue", "chunk"):
        present = op in ops
        s = STRUCTS[op]
        # kernel header include and launcher
        assert (f'#include "kdagen/{op}.h"' in k) == present, op
        assert (f"int {sym}_{op}(const kdagen::{s}* a, void* stream) {{" in k) == present, op
        # binding: extern declaration, host wrapper, schema and impl
        assert (f"int {sym}_{op}(const kdagen::{s}* a, void* stream);" in b) == present, op
        assert (f'm.def("{name}_{op}(' in b) == present, op
        assert (f'm.impl("{name}_{op}", &{op});' in b) == present, op
        assert (f"kdagen::{s} a{{}};" in b) == present, op
        assert (f"check_launch({sym}_{op}(&a, current_stream()), \"{op}\");" in b) == present, op
    # the chunk op's occupancy query: one schema more, with its kernel (no tensors: no impl)
    assert (f'm.def("{name}_chunk_residency() -> int[]", &chunk_residency);' in b) == ("chunk" in ops)
    assert (f"int {sym}_chunk_residency(int* out) {{" in k) == ("chunk" in ops)
    assert b.count("m.def(") == len(ops) + ("chunk" in ops)
    assert b.count("m.impl(") == len(ops)


def test_write_creates_files_and_skips_unchanged(tmp_path):
    r = render(KernelSpec.parse({"target": "gfx942"}))
    folder = tmp_path / "out"
    paths = r.write(folder)
    assert sorted(p.relative_to(folder).as_posix() for p in paths) == sorted(r.files)
    for rel, text in r.files.items():
        assert (folder / rel).read_text() == text
    k = folder / KERNEL_SOURCE
    os.utime(k, ns=(1_000_000_000, 1_000_000_000))
    r.write(folder)
    assert k.stat().st_mtime_ns == 1_000_000_000  # unchanged file not rewritten
    k.write_text("stale")
    r.write(folder)
    assert k.read_text() == r.files[KERNEL_SOURCE]


# ---- generated/ ---------------------------------------------------------------------


def test_generated_folders_are_the_shipped_variants():
    uris = sorted(s.uri for s in shipped_specs())
    assert uris == sorted([
        "kda_d128_c64_bv128_bf16_gfx942-e3b20d6c",
        "kda_d128_c64_bv128_bf16_lb_gfx942-ebf04647",
        "kda_d128_c64_bv128_bf16_lb_sm90-8531df77",
        "kda_d128_c64_bv128_bf16_sm90-8142fdc5",
    ])
    assert sorted(d.name for d in GENERATED.iterdir() if d.is_dir()) == uris


def test_generated_is_not_stale():
    stale = check_generated()
    assert stale == [], "generated/ is stale (run `python -m kdagen.cli generated`): " + ", ".join(stale)


@pytest.fixture
def generated_copy(tmp_path):
    dst = tmp_path / "generated"
    shutil.copytree(GENERATED, dst)
    return dst


def test_check_generated_on_a_clean_copy(generated_copy):
    assert check_generated(generated_copy) == check_generated()


def test_check_generated_detects_a_modified_file(generated_copy):
    before = set(check_generated(generated_copy))
    uri = "kda_d128_c64_bv128_bf16_sm90-8142fdc5"
    f = generated_copy / uri / KERNEL_SOURCE
    f.write_text(f.read_text().replace("kHeadDim = 128;", "kHeadDim = 64;"))
    assert set(check_generated(generated_copy)) - before == {f"{uri}/{KERNEL_SOURCE}"}


def test_check_generated_detects_a_modified_header(generated_copy):
    before = set(check_generated(generated_copy))
    uri = "kda_d128_c64_bv128_bf16_lb_gfx942-ebf04647"
    f = generated_copy / uri / "include" / "kdagen" / "chunk.h"
    f.write_text(f.read_text() + "\n// local edit\n")
    assert set(check_generated(generated_copy)) - before == {f"{uri}/include/kdagen/chunk.h"}


def test_check_generated_detects_missing_and_extra(generated_copy):
    before = set(check_generated(generated_copy))
    uri = "kda_d128_c64_bv128_bf16_gfx942-e3b20d6c"
    (generated_copy / uri / BINDING_SOURCE).unlink()
    (generated_copy / uri / "notes.txt").write_text("x")
    (generated_copy / "kda_old_variant-00000000").mkdir()
    shutil.rmtree(generated_copy / "kda_d128_c64_bv128_bf16_lb_sm90-8531df77")
    stale = set(check_generated(generated_copy)) - before
    assert f"{uri}/{BINDING_SOURCE}" in stale
    assert f"{uri}/notes.txt" in stale
    assert "kda_old_variant-00000000/" in stale
    lb = {s for s in stale if s.startswith("kda_d128_c64_bv128_bf16_lb_sm90-8531df77/")}
    assert len(lb) == len(render(KernelSpec.parse({"gate": "lower_bound"})).files)


def test_check_generated_on_a_missing_root(tmp_path):
    stale = check_generated(tmp_path / "nothing")
    n = sum(len(render(s).files) for s in shipped_specs())
    assert len(stale) == n




@pytest.mark.parametrize("head_dim, rows", [(64, [32, 16]), (128, [32, 16, 8]), (256, [16, 8])])
def test_scan_plans_fit_lds_and_tile_the_block(head_dim, rows):
    """Every group-scan block a variant builds: its ring, state rows and table of products
    within 42 KB (CDNA: 64 KB of LDS; NVIDIA: 48 KB of static shared memory), its 256
    threads tiling the rows and every R tile; most rows first; and each one launched
    (D <= 128: D = 256 builds no chunk scan)."""
    plans = resources.scan_plans(head_dim)
    assert [p.rows for p in plans] == rows
    column_groups = head_dim // 4
    row_groups = resources.SCAN_THREADS // column_groups
    for plan in plans:
        assert plan.shared_bytes(head_dim) <= 42 * 1024
        assert plan.rows % row_groups == 0 and head_dim % plan.tile == 0
        assert (plan.tile * head_dim // 4) % resources.SCAN_THREADS == 0 and plan.stages >= 2
    if head_dim > 128:
        return  # (no chunk scan at D = 256: its state does not fit a lane, spec.py)
    src = render(KernelSpec(target="sm_90", head_dim=head_dim, chunk_size=64, block_width=head_dim))
    text = src.files["kernels.hip"]
    assert "kRows[] = {" + ", ".join(map(str, rows)) + "};" in text
    for plan in plans:
        assert f"group_scan_kernel<Config, {plan.rows}, {plan.stages}>), dim3(D / {plan.rows}, H, N)" in text


@pytest.mark.parametrize("planes, cus, rows", [
    (32, 132, 32),   # 1x32768x32: 128 blocks (session 20, H100: scan 0.064 ms against 0.074 at 16 rows)
    (8, 132, 8),     # 1x131072x8: 128 blocks (0.116 against 0.134 at 16 rows, 0.184 at 32)
    (16, 132, 16),   # 128 blocks
    (256, 132, 32),  # many planes: the most rows
    (1, 132, 8),     # too few planes for half the units at any count: the fewest rows
    (6, 0, 32),      # no compute units read: the most rows
])
def test_scan_rows_for_aims_at_a_block_per_compute_unit(planes, cus, rows):
    assert resources.scan_rows_for(resources.scan_plans(128), 128, planes, cus) == rows


def test_scan_item_limit_is_one_number():
    """The group scan's item limit: launch_args.h's kMaxScanItems is the one resources.py
    counts the scan's LDS by (the binding and chunk.h use the header's)."""
    import re
    from pathlib import Path

    from kdagen import resources

    header = (Path(__file__).resolve().parents[1] / "templates/include/kdagen/launch_args.h").read_text()
    assert int(re.search(r"constexpr int kMaxScanItems = (\d+);", header).group(1)) == resources.MAX_SCAN_ITEMS
