"""Mutation check of the tests: does a wrong index in a template (or in the host code)
fail them?

Each mutant is one small edit of a kernel template or of the host side (chunk numbering,
workspace, segments, argument checks, the float64 reference): an off-by-one, a swapped
index, a flipped sign, a dropped term, which a correct test suite must catch. For each, in a copy
of the working tree: apply the edit, run the tests that cover it (the emulated kernels
by default: they run the generated kernels on the CPU), and record whether they failed
("killed") or passed ("survived": the tests cannot tell the mutant from the kernel).
The unmutated copy runs the same selection first and must pass.

    python3 scripts/mutants.py [--only NAME,...] [--timeout S] [--markdown F] [--skip-baseline] [--list]

CPU only (clang for the emulation); about one to ten minutes a mutant on two cores
for a template mutant (a killed one stops at its first failing test, -x), about 30 s for
a host one (the CPU tests without emulation or compilers).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INC = "templates/include/kdagen"
EMULATED = ("tests/test_emulated_kernels.py",)
# the CPU tests without emulation or compilers (~30 s)
# (not tests/test_mutants.py: it fails on any mutated tree, by design)
FAST = ("tests", "-m", "not emulate and not compile and not gpu", "--ignore=tests/test_mutants.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str   # must occur exactly once in the file
    new: str
    why: str   # what the edit breaks
    tests: tuple[str, ...] = EMULATED  # pytest arguments: the tests that must catch it


MUTANTS = [
    # ---- chunk scan (chunk.h) -------------------------------------------------------------
    Mutant("decay-neighbour", f"{INC}/chunk.h",
           "auto decay_slice = [&](int kt) {\n      mma::for_each(S[kt], [&](int, int k, float& x) { x *= Ds[16 * kt + k]; });",
           "auto decay_slice = [&](int kt) {\n      mma::for_each(S[kt], [&](int, int k, float& x) { x *= Ds[(16 * kt + k) ^ 1]; });",
           "the walk decays each state column by its neighbour's gate (every form of the update)"),
    Mutant("w-copy-piece-vnew", f"{INC}/chunk.h",
           "const int w_off = wr * ld_hd + wc, ",
           "const int w_off = wr * ld_hd + (wc ^ 8), ",
           "pass one with v_new per warpgroup copies w's pieces into the wrong core matrices",
           ("tests/test_emulated_kernels.py", "-k", "warpgroup_state_update and vnew")),
    Mutant("vnew-left-in-flight", f"{INC}/chunk.h",
           "        wg::commit();\n        wg::wait<0>();\n        wg::fence_operands(vn);",
           "        wg::commit();\n        wg::fence_operands(vn);",
           "pass one reads v_new while its warpgroup products are still in flight",
           ("tests/test_emulated_kernels.py", "-k", "warpgroup_state_update and vnew")),
    Mutant("aqk-no-diagonal-block", f"{INC}/chunk.h",
           "for (int cj = 0; cj <= ci; ++cj) {\n            const mma::Frag ab",
           "for (int cj = 0; cj < ci; ++cj) {\n            const mma::Frag ab",
           "o leaves out the in-chunk term of its own diagonal block"),
    Mutant("output-default-scale", f"{INC}/chunk.h",
           "mma::for_each(o[ci], [&](int, int, float& x) { x *= -a.scale; });",
           "mma::for_each(o[ci], [&](int, int, float& x) { x *= -rsqrtf(float(D)); });",
           "the inter-chunk part of o at the default scale, not the one given",
           ("tests/test_emulated_kernels.py", "-k", "prologue_and_chunk")),
    Mutant("output-scale-sign", f"{INC}/chunk.h",
           "mma::for_each(o[ci], [&](int, int, float& x) { x *= -a.scale; });",
           "mma::for_each(o[ci], [&](int, int, float& x) { x *= a.scale; });",
           "the inter-chunk part of o with the wrong sign"),
    # (an edit of the row index i alone is an equivalent mutant: the lanes' read of the LDS
    # row and write of the token row move together, only which lane stores which row changes)
    Mutant("swizzled-o-rows", f"{INC}/chunk.h",
           "*reinterpret_cast<const uint4*>(Us + lds_index<BV, Lay::LDU, true>(i, col + 8 * half));",
           "*reinterpret_cast<const uint4*>(Us + lds_index<BV, Lay::LDU, true>(i ^ 1, col + 8 * half));",
           "the swizzled o store writes each token row from its neighbour's"),
    Mutant("checkpoint-one-chunk-early", f"{INC}/chunk.h",
           "if (ck_tokens > 0 && (c + 1) * C == ck_tokens) {",
           "if (ck_tokens > 0 && (c + 2) * C == ck_tokens) {",
           "the mid-prefill checkpoint holds the state one chunk early"),
    Mutant("transfer-identity-sign", f"{INC}/chunk.h",
           "if (transfer) x = (rowb + r - D == 16 * kt + k) ? -1.0f : 0.0f;",
           "if (transfer) x = (rowb + r - D == 16 * kt + k) ? 1.0f : 0.0f;",
           "unpaired pass one starts the transfer rows at -I, not I"),
    Mutant("paired-transfer-identity-shifted", f"{INC}/chunk.h",
           "mma::for_each(S1[kt], [&](int r, int k, float& x) { x = (row0 + r == 16 * kt + k) ? -1.0f : 0.0f; });",
           "mma::for_each(S1[kt], [&](int r, int k, float& x) { x = (row0 + r == (16 * kt + k) % 16) ? -1.0f : 0.0f; });",
           "paired pass one's transfer rows start as the identity of the first 16 columns only"),
    Mutant("segment-of-group-start", f"{INC}/chunk.h",
           "int segment_of(int p) const { return p <= lead ? 0 : 1 + (p - lead - 1) / pspan; }",
           "int segment_of(int p) const { return p <= lead ? 0 : 1 + (p - lead) / pspan; }",
           "a group start on a segment's end belongs to the next segment"),
    Mutant("last-group-of-final-state", f"{INC}/chunk.h",
           "const int last_group = nc == 0 ? 0 : (nc - 1) / span;",
           "const int last_group = nc == 0 ? 0 : nc / span;",
           "pass two writes the final state from no group where the chunks fill the groups"),
    Mutant("workspace-slots-overlap", f"{INC}/chunk.h",
           "return segments > 1 && segments < groups - 1 ? groups + segments - 2 : groups;",
           "return segments > 1 && segments < groups - 1 ? groups + segments - 3 : groups;",
           "the workspace planes of segmented pass one overlap"),
    Mutant("scan-segment-end-is-start", f"{INC}/chunk.h",
           "end_is_start = seg.start_of_group(gs) == seg.seg_end(s);",
           "end_is_start = false;",
           "the scan reads a segment end the walk never stored where a group starts there"),
    Mutant("scan-drops-b-column", f"{INC}/chunk.h",
           "acc[m].w += b[m].w;",
           "acc[m].w += b[m].z;",
           "the group scan adds the wrong column of B"),
    Mutant("pass-two-start-slot", f"{INC}/chunk.h",
           "if constexpr (kMode == kWalkPassTwo) init = group_plane<Cfg>(a, 2, g, nh);",
           "if constexpr (kMode == kWalkPassTwo) init = group_plane<Cfg>(a, 2, g > 0 ? g - 1 : 0, nh);",
           "pass two starts each group from the previous group's start"),
    Mutant("scan-tile-rows", f"{INC}/chunk.h",
           "items[lead_items + i / TPG].slot, nh) + (i % TPG) * KP * D;",
           "items[lead_items + i / TPG].slot, nh) + ((i + 1) % TPG) * KP * D;",
           "the group scan streams the wrong rows of R into each LDS tile"),
    Mutant("scan-initial-columns", f"{INC}/chunk.h",
           "acc[m] = make_float4(x[0], x[1], x[2], x[3]);",
           "acc[m] = make_float4(x[0], x[1], x[3], x[2]);",
           "the group scan reads the initial state with two columns swapped"),
    Mutant("kg-copy-piece", f"{INC}/chunk.h",
           "(C / 8)) : 8 * tid;",
           "(C / 8)) : 8 * (tid ^ 1);",
           "the one-piece kg_t copy takes its neighbour thread's piece"),
    Mutant("kg-copy-piece-wg", f"{INC}/chunk.h",
           "const int k_src = kWgU ? ((tid / C) * 8 + (tid & 7)) * C",
           "const int k_src = kWgU ? ((tid / C) * 8 + (tid & 7) ^ 1) * C",
           "the one-piece kg_t copy into the core-matrix tile (state update per warpgroup) takes a neighbour row",
           ("tests/test_emulated_kernels.py", "-k", "warpgroup_state_update")),
    Mutant("paged-ignores-has-initial-state", f"{INC}/chunk.h",
           "if (!has || slot < 0 || slot >= a.num_slots) return nullptr;",
           "if (slot < 0 || slot >= a.num_slots) return nullptr;",
           "the walk starts from the cache row where has_initial_state says not to"),
    Mutant("o-store-past-valid", f"{INC}/chunk.h",
           "            const int i = e >> 1, half = e & 1;\n            if (i < valid)",
           "            const int i = e >> 1, half = e & 1;\n            if (i <= valid)",
           "the o store writes one token row past a partial chunk (into the next sequence)"),
    Mutant("scan-rows-choice", "templates/kernels.hip.j2",
           "if (2 * (Config::kHeadDim / rows) * planes >= cus) return rows;",
           "if (2 * (Config::kHeadDim / rows) * planes > cus) return rows;",
           "the launcher's scan rows: a block count just at half the units is not enough",
           ("tests/test_emulated_kernels.py", "-k", "every_group_scan_block")),
    Mutant("scan-rows-kernel", "templates/kernels.hip.j2",
           "group_scan_kernel<Config, {{ p.rows }}, {{ p.stages }}>",
           "group_scan_kernel<Config, {{ scan_plans[-1].rows }}, {{ p.stages }}>",
           "every scan launch runs the fewest-rows kernel on its own grid",
           ("tests/test_emulated_kernels.py", "-k", "every_group_scan_block")),
    Mutant("lead-from-zero", f"{INC}/chunk.h",
           "if constexpr (kMode == kWalkSingle || kLead) init = initial_plane(a, n, h, D);",
           "if constexpr (kMode == kWalkSingle) init = initial_plane(a, n, h, D);",
           "pass one's lead segment walks from zero, not the true start, and skips its transfer",
           ("tests/test_emulated_kernels.py", "-k", "every_group_count")),
    Mutant("lead-items-short", f"{INC}/chunk.h",
           "if (s == 0 && lead) *num_lead = count;",
           "if (s == 0 && lead) *num_lead = count - 1;",
           "the scan takes the lead segment's last item as one with a transfer product",
           ("tests/test_emulated_kernels.py", "-k", "every_group_count")),
    Mutant("lead-boundary", f"{INC}/chunk.h",
           "int segment_of(int p) const { return p <= lead ? 0 : 1 + (p - lead - 1) / pspan; }",
           "int segment_of(int p) const { return p < lead ? 0 : 1 + (p - lead - 1) / pspan; }",
           "a group start at the lead segment's end counted in the next segment",
           ("tests/test_emulated_kernels.py", "-k", "every_group_count")),
    # ---- prologue (prologue.h) ------------------------------------------------------------
    Mutant("conv-taps-reversed", f"{INC}/prologue.h",
           "acc += a.conv_weight[ch * W + j] * x;",
           "acc += a.conv_weight[ch * W + (W - 1 - j)] * x;",
           "the causal conv applies its taps in reverse"),
    Mutant("conv-history-shifted", f"{INC}/prologue.h",
           "* (W - 1) + (W - 1) + (p - bos)];",
           "* (W - 1) + (W - 1) + (p - bos) - 1];",
           "the conv reads its history one token early"),
    Mutant("conv-state-ignores-history-flag", f"{INC}/prologue.h",
           "next[m] = hist ? row[(W - 1) + p] : 0.0f;",
           "next[m] = row[(W - 1) + p];",
           "the saved conv state keeps a history the call said not to use"),
    # ---- decode (recurrent.h) -------------------------------------------------------------
    Mutant("decode-gate-column", f"{INC}/recurrent.h",
           "s[e] = srow[lane + e * kWaveSize] * eg[e];",
           "s[e] = srow[lane + e * kWaveSize] * eg[(e + 1) % PER];",
           "the decode step decays the state by another column's gate"),
    Mutant("decode-beta-outside", f"{INC}/recurrent.h",
           "const float delta = beta * (at(a.v, v) - wave_sum(ks));",
           "const float delta = beta * at(a.v, v) - wave_sum(ks);",
           "the decode step's delta with beta on v only"),
    Mutant("beta-neighbour-token", f"{INC}/prologue.h",
           "static_cast<int64_t>(t0 + tid) * a.beta.token +",
           "static_cast<int64_t>(t0 + (tid ^ 1)) * a.beta.token +",
           "beta of the neighbouring token"),
    Mutant("cumsum-exclusive", f"{INC}/prologue.h",
           "acc += Gs[(r0 + i) * LDG + d];\n        Gs[(r0 + i) * LDG + d] = acc;",
           "const float gi = Gs[(r0 + i) * LDG + d];\n        Gs[(r0 + i) * LDG + d] = acc;\n        acc += gi;",
           "the cumulative gate leaves out each token's own gate"),
    Mutant("cumsum-runs-offset", f"{INC}/prologue.h",
           "for (int p = 0; p < sg; ++p) off +=",
           "for (int p = 0; p + 1 < sg; ++p) off +=",
           "a run of the split cumsum leaves out the run just above it"),
    Mutant("decay-row-early", f"{INC}/prologue.h",
           "decay_out[d] = exp2f(Gs[last * LDG + gcol(d)]);",
           "decay_out[d] = exp2f(Gs[(last > 0 ? last - 1 : 0) * LDG + gcol(d)]);",
           "the chunk's decay one token early (the outputs hid it at 2e-2 in the softplus cases)",
           ("tests/test_emulated_kernels.py", "-k", "prologue_and_chunk")),
    Mutant("decay-scan-row-early", f"{INC}/prologue.h",
           "if constexpr (SEG == 1) decay_out[e] = exp2f(acc);",
           "if constexpr (SEG == 1) decay_out[e] = exp2f(Gs[(RUN - 2) * LDG + d]);",
           "the decay stored by the cumsum one token early (one run per column: chunk 16)",
           ("tests/test_emulated_kernels.py", "-k", "prologue_and_chunk")),
    Mutant("decay-scan-column", f"{INC}/prologue.h",
           "if constexpr (SEG == 1) decay_out[e] = exp2f(acc);",
           "if constexpr (SEG == 1) decay_out[e ^ 1] = exp2f(acc);",
           "the decay stored by the cumsum in the neighbouring column"),
    Mutant("aqk-default-scale", f"{INC}/prologue.h",
           "mma::for_each(accQ, [&](int r, int c, float& x) { x = diag && c > r ? 0.0f : a.scale * x; });",
           "mma::for_each(accQ, [&](int r, int c, float& x) { x = diag && c > r ? 0.0f : 0.08838835f * x; });",
           "aqk's matrix-unit blocks at d128's default scale, not the one given",
           ("tests/test_emulated_kernels.py", "-k", "prologue_and_chunk")),
    Mutant("decode-default-scale", f"{INC}/recurrent.h",
           "if (lane == 0) out[v] = from_float<Io>(a.scale * qs);",
           "if (lane == 0) out[v] = from_float<Io>(rsqrtf(float(D)) * qs);",
           "the decode step's output at the default scale, not the one given",
           ("tests/test_emulated_kernels.py", "-k", "test_recurrent")),
    Mutant("decay-column", f"{INC}/prologue.h",
           "decay_out[d] = exp2f(Gs[last * LDG + gcol(d)]);",
           "decay_out[d] = exp2f(Gs[last * LDG + gcol(d ^ 1)]);",
           "the chunk's decay of the neighbouring column"),
    Mutant("k-norm-of-q", f"{INC}/prologue.h",
           "rk[i] = i < valid ? rnorm(kk[m]) : 0.0f;",
           "rk[i] = i < valid ? rnorm(qq[m]) : 0.0f;",
           "k normalised by q's norm (the per-wave norm path)"),
    Mutant("k-norm-of-q-planar", f"{INC}/prologue.h",
           "rk[i] = i < valid ? rnorm(sk) : 0.0f;",
           "rk[i] = i < valid ? rnorm(sq) : 0.0f;",
           "k normalised by q's norm (the planar path)"),
    Mutant("lower-bound-bias-sign", f"{INC}/prologue.h",
           "gv[j] = __fdividef(lbi, 1.0f + exp2_fast(fmaf(raw8[j], na, bs[j])));",
           "gv[j] = __fdividef(lbi, 1.0f + exp2_fast(fmaf(raw8[j], na, -bs[j])));",
           "the lower-bound gate with dt_bias subtracted"),
    Mutant("softplus-bias-column", f"{INC}/prologue.h",
           "gv[j] = in ? -a_exp * softplus_log2(fmaf(raw8[j], kLog2e, bs[j])) : 0.0f;",
           "gv[j] = in ? -a_exp * softplus_log2(fmaf(raw8[j], kLog2e, bs[(j + 1) % VEC])) : 0.0f;",
           "the softplus gate takes the next column's dt_bias"),
    # ---- vendor layers --------------------------------------------------------------------
    Mutant("cuda-state-rows-swapped", f"{INC}/vendor_cuda.h",
           "make_float2(s * c.v[i], s * c.v[i + 1]);",
           "make_float2(s * c.v[i + 1], s * c.v[i]);",
           "sm_90's 8-byte state stores swap neighbouring columns"),
    Mutant("cdna-accumulator-column", f"{INC}/vendor_cdna.h",
           "f(r, 4 * q + j, x);",
           "f(r, 4 * q + (j ^ 1), x);",
           "CDNA's accumulator layout with neighbouring columns swapped"),

    # ---- host side: chunk numbering, workspace, segments, checks, the float64 reference ----
    Mutant("chunk-count-ceil", "kdagen/varlen.py",
           "lens + (chunk_size - 1), chunk_size",
           "lens + chunk_size, chunk_size",
           "a sequence of whole chunks counts one chunk more", FAST),
    Mutant("chunk-indices-inclusive-offsets", "kdagen/varlen.py",
           "offsets = torch.cumsum(counts, 0) - counts  # exclusive prefix sum",
           "offsets = torch.cumsum(counts, 0)  # exclusive prefix sum",
           "chunk indices numbered from each sequence's end", FAST),
    Mutant("workspace-slots-host", "kdagen/groups.py",
           "slots = groups + p - 2 if 1 < p < groups - 1 else groups",
           "slots = groups + p - 3 if 1 < p < groups - 1 else groups",
           "the host allocates one workspace slot too few for segmented pass one", FAST),
    Mutant("segment-batches-floor", "kdagen/groups.py",
           "steps = lambda p: -(-p * per_seg // slots) / p",
           "steps = lambda p: (p * per_seg // slots) / p",
           "the segment heuristic counts batches of blocks rounded down", FAST),
    Mutant("segment-count-bound", "kdagen/checks.py",
           "if segments < 0 or segments > top:",
           "if segments < 0 or segments > top + 1:",
           "the op accepts as many segments as groups", FAST),
    Mutant("cu-seqlens-decreasing", "kdagen/checks.py",
           "if vals[i] < vals[i - 1]), None)",
           "if vals[i] < vals[i - 1] - 1), None)",
           "cu_seqlens may step back by one", FAST),
    Mutant("reference-strict-mask", "kdagen/reference.py",
           "strict = (ii[:, None] > ii[None, :])[None, :, :, None]",
           "strict = (ii[:, None] >= ii[None, :])[None, :, :, None]",
           "the chunked reference's L takes its diagonal", FAST),
    Mutant("reference-checkpoint-early", "kdagen/reference.py",
           "if ckpt is not None and t - bos + 1 == offs[n]:",
           "if ckpt is not None and t - bos + 2 == offs[n]:",
           "the token recurrence's checkpoint one token early", FAST),
    Mutant("reference-lower-bound-gate", "kdagen/reference.py",
           "return float(lower_bound) * torch.sigmoid(a * x)",
           "return float(lower_bound) * torch.sigmoid(x)",
           "the reference's lower-bound gate without exp(A_log)", FAST),
]


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout', seconds, the last lines of pytest's output)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - t0, ""
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-3:])
    return ("passed" if p.returncode == 0 else "failed"), time.time() - t0, tail


def copy_tree(dst: Path) -> None:
    """The working tree's files that git tracks or would add (not build/, caches)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma separated mutant names (default: all)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per test run")
    ap.add_argument("--markdown", help="append the result table here")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument("--skip-baseline", action="store_true",
                    help="do not run the unmutated tests first (they passed on this tree already)")
    ns = ap.parse_args(argv)
    chosen = MUTANTS
    if ns.only:
        names = {n.strip() for n in ns.only.split(",") if n.strip()}
        unknown = names - {m.name for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
        chosen = [m for m in MUTANTS if m.name in names]
    for m in chosen:  # every edit must apply to the current templates
        count = (ROOT / m.path).read_text().count(m.old)
        if count != 1:
            print(f"mutants: {m.name}: its text occurs {count} times in {m.path} (needs 1)")
            return 2
    if ns.list:
        for m in chosen:
            print(f"{m.name:34} {m.path.split('/')[-1]:14} {m.why}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="kdagen-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for tests in [] if ns.skip_baseline else sorted({m.tests for m in chosen}):
            status, secs, tail = run_tests(tree, tests, ns.timeout)
            print(f"baseline ({' '.join(tests)}): {status} in {secs:.0f} s", flush=True)
            if status != "passed":
                print(tail)
                return 1
        for m in chosen:
            path = tree / m.path
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new))
            try:
                status, secs, tail = run_tests(tree, m.tests, ns.timeout)
            finally:
                path.write_text(original)
            verdict = {"failed": "killed", "passed": "SURVIVED"}.get(status, status)
            first_fail = next((line for line in tail.splitlines() if line.startswith("FAILED")), "")
            rows.append((m, verdict, secs, first_fail))
            print(f"{m.name:34} {verdict:9} {secs:6.0f} s  {first_fail[:120]}", flush=True)
    table = ["| mutant | file | what it breaks | verdict | s | first failing test |", "|---|---|---|---|---|---|"]
    for m, verdict, secs, first in rows:
        test = first.removeprefix("FAILED ").split(" - ")[0]
        table.append(f"| {m.name} | {m.path.split('/')[-1]} | {m.why} | {verdict} | {secs:.0f} | {test} |")
    print("\n".join(table))
    if ns.markdown:
        with open(ns.markdown, "a") as f:
            f.write("\n".join(table) + "\n")
    return 0 if all(v == "killed" for _, v, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
