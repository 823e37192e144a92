"""KernelSpec: defaults, canonical form, content hash, names, refusals, YAML loading.

CPU only, no compiler: every test here runs in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from kdagen import resources
from kdagen.spec import ALL_OPS, KernelSpec, SpecError, load_yaml, spec_from_any
from kdagen.targets import TARGETS

REPO = Path(__file__).resolve().parent.parent
FIELDS = ("head_dim", "chunk_size", "block_width", "io_dtype", "gate", "conv_width", "target", "ops")

DEFAULT_CANONICAL = {
    "head_dim": 128,
    "chunk_size": 64,
    "block_width": 128,
    "io_dtype": "bf16",
    "gate": "softplus",
    "conv_width": 0,
    "target": "sm_90",
    "ops": ["recurrent", "prologue", "chunk"],
}


def refusal(data, source: str = "spec") -> str:
    """The message of the SpecError that ``data`` must raise."""
    with pytest.raises(SpecError) as exc:
        KernelSpec.parse(data, source=source)
    msg = str(exc.value)
    assert msg.startswith(f"{source}: "), msg
    assert "\n" not in msg, f"refusal is not one line: {msg!r}"
    return msg


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KDAGEN_ARCH", None)
    env["PYTHONHASHSEED"] = "12345"  # a different str-hash seed from this process
    return env


# ---- defaults and canonical form ---------------------------------------------------


def test_defaults():
    s = KernelSpec.parse({})
    assert (s.head_dim, s.chunk_size, s.block_width) == (128, 64, 128)
    assert (s.io_dtype, s.gate, s.conv_width, s.target) == ("bf16", "softplus", 0, "sm_90")
    assert s.ops == ALL_OPS == ("recurrent", "prologue", "chunk")
    assert KernelSpec() == s
    assert s.target_info is TARGETS["sm_90"]


def test_canonical_is_every_field_with_defaults_resolved():
    c = KernelSpec.parse({}).canonical()
    assert c == DEFAULT_CANONICAL
    assert list(c) == list(FIELDS)
    # JSON-native: round-trips through json unchanged
    assert json.loads(json.dumps(c)) == c


@pytest.mark.parametrize(
    "head_dim, expected_bv", [(64, 64), (128, 128), (256, 128)]
)
def test_default_block_width_follows_head_dim(head_dim, expected_bv):
    s = KernelSpec.parse({"head_dim": head_dim, "ops": ["recurrent"]})
    assert s.block_width == expected_bv
    assert KernelSpec.parse({"head_dim": head_dim, "block_width": None, "ops": ["recurrent"]}) == s
    assert KernelSpec(head_dim=head_dim, ops=("recurrent",)).block_width == expected_bv


def test_ops_are_canonicalised_order_and_duplicates():
    s = KernelSpec.parse({"ops": ["chunk", "recurrent", "chunk"]})
    assert s.ops == ("recurrent", "chunk")
    assert s.canonical()["ops"] == ["recurrent", "chunk"]


def test_equivalent_inputs_share_canonical_form_and_hash():
    forms = [
        {},
        {"block_width": None},
        {"block_width": 128},
        {"ops": ["chunk", "prologue", "recurrent"]},
        {"ops": ("recurrent", "recurrent", "prologue", "chunk")},
        dict(DEFAULT_CANONICAL),
    ]
    specs = [KernelSpec.parse(f) for f in forms]
    assert all(s.canonical() == DEFAULT_CANONICAL for s in specs)
    assert len({s.content_hash for s in specs}) == 1
    assert len({s.uri for s in specs}) == 1


def test_spec_is_frozen():
    s = KernelSpec.parse({})
    with pytest.raises(pydantic.ValidationError):
        s.head_dim = 64  # type: ignore[misc]
    assert s.head_dim == 128


def test_parse_passes_a_spec_through_and_spec_from_any(tmp_path):
    s = KernelSpec.parse({"head_dim": 64})
    assert KernelSpec.parse(s) is s
    assert spec_from_any(s) is s
    assert spec_from_any({"head_dim": 64}) == s
    p = tmp_path / "s.yaml"
    p.write_text("head_dim: 64\n")
    assert spec_from_any(p) == s
    assert spec_from_any(str(p)) == s


def test_example_default_yaml_is_the_default_spec():
    assert KernelSpec.from_yaml(REPO / "examples" / "default.yaml") == KernelSpec.parse({})


# ---- content hash -------------------------------------------------------------------


def test_content_hash_is_sha256_of_canonical_json():
    import hashlib

    s = KernelSpec.parse({"head_dim": 64, "target": "gfx942"})
    blob = json.dumps(s.canonical(), sort_keys=True, separators=(",", ":"))
    assert s.content_hash == hashlib.sha256(blob.encode()).hexdigest()
    assert len(s.content_hash) == 64
    assert s.uri == f"{s.name}-{s.content_hash[:8]}"


def test_content_hash_pinned():
    # Pinned: the build cache and the folders of generated/ are keyed by it. A change
    # here silently invalidates every cached build and the committed generated/ names.
    s = KernelSpec.parse({})
    assert s.uri == "kda_d128_c64_bv128_bf16_sm90-8142fdc5"
    assert KernelSpec.parse({"target": "gfx942"}).uri == "kda_d128_c64_bv128_bf16_gfx942-e3b20d6c"


def test_content_hash_differs_for_every_field():
    base = KernelSpec.parse({"ops": ["recurrent", "prologue"]})
    changes = [
        {"head_dim": 256},
        {"chunk_size": 32},
        {"block_width": 64},
        {"io_dtype": "fp16"},
        {"gate": "lower_bound"},
        {"conv_width": 4},
        {"target": "gfx942"},
        {"ops": ["recurrent"]},
    ]
    hashes = {base.content_hash}
    for ch in changes:
        s = KernelSpec.parse({**base.canonical(), **ch})
        assert s.content_hash not in hashes, ch
        hashes.add(s.content_hash)


SUBPROCESS_SPECS = [
    {},
    {"head_dim": 64, "chunk_size": 32, "io_dtype": "fp16", "gate": "lower_bound", "conv_width": 4,
     "target": "gfx942"},
    {"ops": ["chunk", "recurrent"], "block_width": 32, "target": "gfx90a"},
]


def test_content_hash_stable_across_processes():
    code = (
        "import json, sys\n"
        "from kdagen.spec import KernelSpec\n"
        "specs = json.loads(sys.argv[1])\n"
        "print(json.dumps([[KernelSpec.parse(d).content_hash, KernelSpec.parse(d).uri] for d in specs]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(SUBPROCESS_SPECS)],
        capture_output=True, text=True, env=_subprocess_env(), cwd=str(REPO), timeout=60,
    )
    assert out.returncode == 0, out.stderr
    theirs = json.loads(out.stdout)
    ours = [[KernelSpec.parse(d).content_hash, KernelSpec.parse(d).uri] for d in SUBPROCESS_SPECS]
    assert theirs == ours
    assert len({h for h, _ in ours}) == len(ours)


# ---- names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, name",
    [
        ({}, "kda_d128_c64_bv128_bf16_sm90"),
        ({"gate": "lower_bound"}, "kda_d128_c64_bv128_bf16_lb_sm90"),
        ({"conv_width": 4}, "kda_d128_c64_bv128_bf16_conv4_sm90"),
        ({"conv_width": 2, "gate": "lower_bound"}, "kda_d128_c64_bv128_bf16_lb_conv2_sm90"),
        ({"ops": ["recurrent"]}, "kda_d128_c64_bv128_bf16_ops_rec_sm90"),
        ({"ops": ["chunk", "recurrent"]}, "kda_d128_c64_bv128_bf16_ops_rec_chu_sm90"),
        ({"ops": ["prologue"]}, "kda_d128_c64_bv128_bf16_ops_pro_sm90"),
        ({"ops": ["recurrent", "prologue", "chunk"]}, "kda_d128_c64_bv128_bf16_sm90"),
        ({"io_dtype": "fp32", "ops": ["recurrent"]}, "kda_d128_c64_bv128_fp32_ops_rec_sm90"),
        ({"head_dim": 64, "chunk_size": 32, "io_dtype": "fp16"}, "kda_d64_c32_bv64_fp16_sm90"),
        ({"block_width": 32}, "kda_d128_c64_bv32_bf16_sm90"),
        ({"target": "gfx942"}, "kda_d128_c64_bv128_bf16_gfx942"),
        ({"target": "gfx90a", "gate": "lower_bound"}, "kda_d128_c64_bv128_bf16_lb_gfx90a"),
        ({"target": "gfx950", "head_dim": 256}, "kda_d256_c64_bv128_bf16_gfx950"),
        ({"target": "gfx942", "head_dim": 256, "chunk_size": 16, "conv_width": 3,
          "ops": ["prologue", "recurrent"]}, "kda_d256_c16_bv128_bf16_conv3_ops_rec_pro_gfx942"),
    ],
)
def test_names(fields, name):
    s = KernelSpec.parse(fields)
    assert s.name == name
    assert s.uri.startswith(name + "-")


def test_target_tags():
    assert {n: t.tag for n, t in TARGETS.items()} == {
        "gfx90a": "gfx90a", "gfx942": "gfx942", "gfx950": "gfx950", "sm_90": "sm90",
    }


# ---- refusals -----------------------------------------------------------------------


def test_unknown_key_named_with_known_fields():
    msg = refusal({"head_dmi": 128})
    assert "unknown field 'head_dmi'" in msg
    assert "known fields: " + ", ".join(FIELDS) in msg


def test_several_problems_reported_together():
    msg = refusal({"head_dim": 96, "colour": "red"})
    assert "field 'head_dim' = 96" in msg
    assert "unknown field 'colour'" in msg


@pytest.mark.parametrize(
    "head_dim, bv, allowed",
    [(128, 48, "16, 32, 64, 128"), (64, 128, "16, 32, 64"), (256, 96, "16, 32, 64, 128, 256"),
     (128, 0, "16, 32, 64, 128"), (128, -16, "16, 32, 64, 128"), (128, 8, "16, 32, 64, 128")],
)
def test_block_width_must_divide_head_dim(head_dim, bv, allowed):
    msg = refusal({"head_dim": head_dim, "block_width": bv, "ops": ["recurrent"]})
    assert f"block_width = {bv}" in msg
    assert f"head_dim ({head_dim})" in msg
    assert msg.endswith(f"allowed: {allowed}")


def test_head_dim_96_lists_allowed():
    msg = refusal({"head_dim": 96})
    assert "field 'head_dim' = 96" in msg
    assert "64, 128 or 256" in msg


@pytest.mark.parametrize("field, value, allowed", [
    ("chunk_size", 48, "16, 32 or 64"),
    ("io_dtype", "int8", "'bf16', 'fp16' or 'fp32'"),
    ("gate", "relu", "'softplus' or 'lower_bound'"),
    ("conv_width", 5, "0, 2, 3 or 4"),
])
def test_literal_fields_list_allowed(field, value, allowed):
    msg = refusal({field: value})
    assert f"field {field!r} = {value!r}" in msg
    assert allowed in msg


def test_unknown_op_named():
    msg = refusal({"ops": ["recurrent", "decode"]})
    assert "field 'ops.1' = 'decode'" in msg
    assert "'recurrent', 'prologue' or 'chunk'" in msg


def test_empty_ops_refused():
    msg = refusal({"ops": []})
    assert "field 'ops'" in msg
    assert "recurrent, prologue, chunk" in msg


def test_unknown_target_lists_known():
    msg = refusal({"target": "gfx1100"})
    assert "field 'target' = 'gfx1100'" in msg
    assert "unknown target 'gfx1100'" in msg
    assert "known targets: gfx90a, gfx942, gfx950, sm_90" in msg


@pytest.mark.parametrize("ops, named", [
    (None, "['prologue', 'chunk']"),
    (["recurrent", "chunk"], "['chunk']"),
    (["prologue"], "['prologue']"),
])
def test_fp32_refused_with_prefill_ops(ops, named):
    fields = {"io_dtype": "fp32"} if ops is None else {"io_dtype": "fp32", "ops": ops}
    msg = refusal(fields)
    assert f"io_dtype = fp32 with ops {named}" in msg
    assert "bf16 or fp16" in msg and "ops: [recurrent]" in msg


def test_fp32_recurrent_only_is_fine():
    assert KernelSpec.parse({"io_dtype": "fp32", "ops": ["recurrent"]}).io_dtype == "fp32"


@pytest.mark.parametrize("ops", [["recurrent"], ["chunk"], ["recurrent", "chunk"]])
def test_conv_without_prologue_refused(ops):
    msg = refusal({"conv_width": 4, "ops": ops})
    assert "conv_width = 4" in msg
    assert "add 'prologue' to ops or set conv_width: 0" in msg


def test_prologue_lds_overflow_on_gfx942():
    msg = refusal({"head_dim": 256, "chunk_size": 64, "target": "gfx942"})
    # G fp32 (64 x 260 x 4) + k bf16 (64 x 264 x 2) + three fp32 vectors (3 x 64 x 4)
    need = 64 * 260 * 4 + 64 * 264 * 2 + 3 * 64 * 4
    assert need == 101120
    assert "chunk_size = 64, head_dim = 256" in msg
    assert f"the prologue needs {need} bytes of shared memory, gfx942 has 65536" in msg
    assert "use a smaller chunk_size" in msg


def test_chunk_scan_lds_overflow_on_gfx942():
    msg = refusal({"head_dim": 256, "chunk_size": 64, "target": "gfx942", "ops": ["chunk"]})
    # 2 x C x (K+8) + K x (C+8) + C x (C+8) bf16 elements + K fp32 decay values
    need = (2 * 64 * 264 + 256 * 72 + 64 * 72) * 2 + 256 * 4
    assert need == 114688
    assert f"the chunk scan needs {need} bytes of shared memory, gfx942 has 65536" in msg


def test_head_dim_256_fits_with_smaller_chunk_or_bigger_lds():
    assert KernelSpec.parse({"head_dim": 256, "chunk_size": 32, "target": "gfx942"}).chunk_size == 32
    # gfx950 has 160 KiB of LDS: chunk 64 fits there
    assert KernelSpec.parse({"head_dim": 256, "target": "gfx950"}).target == "gfx950"


def test_head_dim_256_chunk_scan_on_sm90_register_limit():
    for fields in ({"head_dim": 256}, {"head_dim": 256, "chunk_size": 16, "ops": ["chunk"]}):
        msg = refusal({**fields, "target": "sm_90"})
        regs = 16 * 256 // 32
        assert regs == 128
        assert f"head_dim = 256 on sm_90: the chunk scan would keep {regs} fp32 state values" in msg
        assert f"at most {resources.MAX_STATE_REGS_PER_LANE}" in msg
        assert "build ops: [recurrent]" in msg
    # the decode kernel and the prologue alone do not hold the state in registers
    assert KernelSpec.parse({"head_dim": 256, "ops": ["recurrent", "prologue"]}).head_dim == 256


def test_refusal_names_the_source():
    msg = refusal({"head_dim": 96}, source="my/spec.yaml")
    assert msg.startswith("my/spec.yaml: invalid spec: ")


@pytest.mark.parametrize("data, kind", [([], "list"), ("head_dim: 128", "str"), (None, "NoneType"),
                                        (128, "int")])
def test_non_mapping_refused(data, kind):
    msg = refusal(data)
    assert msg == f"spec: a spec is a mapping of fields, got {kind}"


@pytest.mark.parametrize("field, value, kind", [
    ("block_width", "64", "str"), ("head_dim", "128", "str"), ("chunk_size", "32", "str"),
    ("conv_width", False, "bool"), ("block_width", True, "bool"), ("head_dim", 128.5, "float"),
    ("chunk_size", None, "NoneType"),
])
def test_integer_fields_take_integers_only(field, value, kind):
    """pydantic's lax mode would turn block_width: '64' into 64 and conv_width: false into
    0 (while refusing head_dim: '128'); every integer field refuses them alike."""
    msg = refusal({field: value})
    assert f"field {field!r} = {value!r}: must be an integer, got {kind}" in msg


def test_float_head_dim_gets_the_same_default_block_width():
    assert KernelSpec.parse({"head_dim": 128.0}) == KernelSpec.parse({"head_dim": 128})
    assert KernelSpec.parse({"head_dim": 64.0}) == KernelSpec.parse({"head_dim": 64})


# ---- YAML files ---------------------------------------------------------------------


def test_from_yaml_reads_fields(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("# a comment\nhead_dim: 64\nchunk_size: 32\ngate: lower_bound\ntarget: gfx942\n"
                 "ops: [prologue, recurrent]\n")
    s = KernelSpec.from_yaml(p)
    assert s.name == "kda_d64_c32_bv64_bf16_lb_ops_rec_pro_gfx942"


def test_empty_yaml_file_is_the_default_spec(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing but a comment\n")
    assert KernelSpec.from_yaml(p) == KernelSpec.parse({})


@pytest.mark.parametrize("text, line", [
    ("head_dim: 128\nchunk_size: [64\n", 3),        # unterminated flow sequence
    ("head_dim: 128\nops: a: b\n", 2),              # mapping value inside a scalar
    ("head_dim: 128\n\ttarget: sm_90\n", 2),        # tab indentation
    ("head_dim: 128\ntarget: 'sm_90\n", 3),         # unterminated quote
    ("head_dim: 128\n  chunk_size: 64\n", 2),       # bad indentation
])
def test_malformed_yaml_names_file_and_line(tmp_path, text, line):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as exc:
        KernelSpec.from_yaml(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: line {line}, column "), msg
    assert "malformed YAML: " in msg


def test_yaml_list_is_not_a_spec(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- head_dim: 128\n- chunk_size: 64\n")
    with pytest.raises(SpecError) as exc:
        KernelSpec.from_yaml(p)
    assert str(exc.value) == f"{p}: a spec is a mapping of fields, got list"


def test_yaml_scalar_is_not_a_spec(tmp_path):
    p = tmp_path / "scalar.yaml"
    p.write_text("sm_90\n")
    with pytest.raises(SpecError) as exc:
        KernelSpec.from_yaml(p)
    assert str(exc.value) == f"{p}: a spec is a mapping of fields, got str"


def test_yaml_refusal_names_the_file(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("head_dim: 96\n")
    with pytest.raises(SpecError) as exc:
        KernelSpec.from_yaml(p)
    assert str(exc.value).startswith(f"{p}: invalid spec: field 'head_dim' = 96")


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as exc:
        KernelSpec.from_yaml(p)
    assert str(exc.value) == f"{p}: cannot read: No such file or directory"


@pytest.mark.parametrize("text", ["[]\n", "false\n", "0\n", "''\n"])
def test_falsy_non_mapping_yaml_is_refused(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(SpecError, match="a spec is a mapping of fields"):
        KernelSpec.from_yaml(p)


@pytest.mark.parametrize("content", [
    b"head_dim: 2001-13-45\n",
    b"head_dim: !!int abc\n",
    b"head_dim: !!float x\n",
    b"head_dim: !!bool maybe\n",
    b"head_dim: " + b"[" * 1100 + b"]" * 1100 + b"\n",
    b"head_dim: \xff\xfe\n",
], ids=["bad-date", "bad-int", "bad-float", "bad-bool", "deep-nesting", "not-utf8"])
def test_yaml_constructor_errors_are_spec_errors(tmp_path, content):
    p = tmp_path / "s.yaml"
    p.write_bytes(content)
    with pytest.raises(SpecError) as exc:
        KernelSpec.from_yaml(p)
    assert str(exc.value).startswith(f"{p}:")


def test_yaml_reader_error_names_line(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("head_dim: 128\ntarget: sm\x07_90\n")
    with pytest.raises(SpecError) as exc:
        KernelSpec.from_yaml(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: line 2, column ")
    assert "\n" not in msg


def test_load_yaml_returns_the_document(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text("grid:\n  head_dim: [64, 128]\n")
    assert load_yaml(p) == {"grid": {"head_dim": [64, 128]}}


# ---- with_target --------------------------------------------------------------------


def test_with_target_changes_only_the_target():
    s = KernelSpec.parse({"head_dim": 64, "chunk_size": 32, "gate": "lower_bound", "conv_width": 2})
    g = s.with_target("gfx942")
    assert g.target == "gfx942" and g.target_info.vendor == "amd"
    assert {k: v for k, v in g.canonical().items() if k != "target"} == \
        {k: v for k, v in s.canonical().items() if k != "target"}
    assert s.target == "sm_90"  # the original is untouched
    assert g.name == "kda_d64_c32_bv64_bf16_lb_conv2_gfx942"
    assert g.content_hash != s.content_hash
    assert s.with_target("sm_90") == s
    assert g.with_target("sm_90") == s


def test_with_target_keeps_the_resolved_block_width():
    s = KernelSpec.parse({"head_dim": 256, "ops": ["recurrent"]})
    assert s.with_target("gfx90a").block_width == 128


def test_with_target_unknown_target():
    with pytest.raises(SpecError) as exc:
        KernelSpec.parse({}).with_target("sm_80")
    msg = str(exc.value)
    assert "unknown target 'sm_80'" in msg and "known targets: gfx90a, gfx942, gfx950, sm_90" in msg


def test_with_target_revalidates_resources():
    s = KernelSpec.parse({"head_dim": 256, "target": "gfx950"})
    with pytest.raises(SpecError, match="the prologue needs 101120 bytes of shared memory, gfx942 has 65536"):
        s.with_target("gfx942")
    with pytest.raises(SpecError, match="head_dim = 256 on sm_90"):
        s.with_target("sm_90")


@pytest.mark.parametrize("target", ["gfx90a", "gfx942", "gfx950"])
def test_cdna_chunk_blocks_of_more_than_eight_waves_are_refused(target):
    """16 waves of 64 would get 128 registers a lane each and spill around the state."""
    msg = refusal({"head_dim": 256, "chunk_size": 32, "block_width": 256, "target": target})
    assert "16 waves of 64" in msg and "use block_width <= 128" in msg
    assert KernelSpec.parse({"head_dim": 256, "chunk_size": 32, "block_width": 128,
                             "target": target}).block_width == 128


@pytest.mark.parametrize("fields, resident", [
    (dict(target="gfx90a", chunk_size=64, block_width=64), 1),   # 2 x 33 KB > 64 KB of LDS
    (dict(target="gfx942", chunk_size=64, block_width=64), 1),
    (dict(target="sm_90", chunk_size=16, block_width=128), 1),  # eight waves a block
    (dict(target="sm_90", chunk_size=16, block_width=64), 2),   # two blocks of four
])
def test_pass_one_residency_counts_the_compute_units_lds(fields, resident):
    """The segment heuristic's pass-one blocks per compute unit (ChunkPlan.pass_one_resident)
    never exceed what the unit's LDS holds."""
    from kdagen.render import chunk_plan_for

    s = KernelSpec.parse(fields)
    assert chunk_plan_for(s).pass_one_resident(s.block_width) == resident


def test_uri_follows_the_fields_of_a_copy():
    """uri is cached per field set, not per object: a copy with a field changed names its
    own build (a copy made by pydantic keeps no value of the original's)."""
    s = KernelSpec.parse({"target": "sm_90"})
    assert s.uri.startswith(s.name)
    c = s.model_copy(update={"block_width": 64})
    assert c.block_width == 64 and "bv64" in c.name
    assert c.uri == KernelSpec.parse({"target": "sm_90", "block_width": 64}).uri != s.uri
