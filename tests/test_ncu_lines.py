"""scripts/ncu_lines.py: an ncu SASS-page csv joined with an nvdisasm -g listing by offset."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ncu_lines", ROOT / "scripts" / "ncu_lines.py")
ncu_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_lines)

LISTING = """\
.text._ZN6kdagen12other_kernelEv:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.text._ZN6kdagen15prologue_kernelINS_6ConfigEEEvNS_12PrologueArgsE:
\t//## File "/x/include/kdagen/prologue.h", line 136
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R31, SR_CTAID.X ;
\t//## File "/x/include/kdagen/prologue.h", line 647
        /*0020*/              @!P0 STG.E.128 desc[UR12][R14.64], R8 ;
        /*0030*/                   EXIT ;
"""

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [
    ["0x7f0000001000", "LDC R1, c[0x0][0x28]", "10", "100", "8", "1", "8"],
    ["0x7f0000001010", "S2R R31, SR_CTAID.X", "30", "100", "0", "30", "0"],
    ["0x7f0000001020", "@!P0 STG.E.128 desc[UR12][R14.64], R8", "60", "50", "50", "5", "50"],
    ["0x7f0000001030", "BRA 0x7f0000001030", "0", "0", "0", "0", "0"],  # not EXIT: a mismatch
]


def _write(tmp_path: Path) -> tuple[Path, Path]:
    csv_path = tmp_path / "sass.csv.gz"
    lines = ['"Kernel Name","prologue_kernel",""', ",".join(f'"{h}"' for h in HEADER)]
    lines += [",".join(f'"{c}"' for c in r) for r in ROWS]
    with gzip.open(csv_path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    listing = tmp_path / "listing.sass"
    listing.write_text(LISTING)
    return csv_path, listing


def test_rows_join_their_source_lines(tmp_path):
    csv_path, listing = _write(tmp_path)
    name, rows = ncu_lines.read_ncu_sass(csv_path)
    assert name == "prologue_kernel" and len(rows) == 4
    lst = ncu_lines.read_listing(listing, "prologue_kernel")
    assert lst[0x20] == (("prologue.h", 647), "STG.E.128")  # the predicate is not the opcode
    agg, bad = ncu_lines.per_line(rows, lst)
    assert bad == 1
    assert agg[("prologue.h", 136)]["inst"] == 200 and agg[("prologue.h", 136)]["samples"] == 40
    assert agg[("prologue.h", 647)]["long_sb"] == 50 + 0  # issued-and-not reasons are not summed twice
    text = ncu_lines.report(agg, 2)
    first = text.splitlines()[1]
    assert first.startswith("prologue.h:647") and "samples  60.0%" in first and "long_sb 0.83" in first


def test_other_kernels_in_the_listing_are_left_out(tmp_path):
    _, listing = _write(tmp_path)
    lst = ncu_lines.read_listing(listing, "prologue_kernel")
    assert set(lst) == {0x0, 0x10, 0x20, 0x30}
    assert lst[0x0][1] == "LDC"


def test_the_csv_kernel_name_picks_one_mode_of_the_walk(tmp_path):
    lst = tmp_path / "l.sass"
    lst.write_text(".text._ZN6kdagen12chunk_kernelINS_6ConfigELi2EEEvNS_9ChunkArgsE:\n"
                   "        /*0000*/                   EXIT ;\n"
                   ".text._ZN6kdagen12chunk_kernelINS_6ConfigELi0EEEvNS_9ChunkArgsE:\n"
                   "        /*0000*/                   NOP ;\n")
    pat = ncu_lines.mangled_pattern("chunk_kernel", "void kdagen::chunk_kernel<kdagen::Config, 0>(kdagen::ChunkArgs)")
    assert ncu_lines.read_listing(lst, pat)[0][1] == "NOP"
    # ncu's csv spells the template argument with its type
    pat = ncu_lines.mangled_pattern("chunk_kernel", "void kdagen::chunk_kernel<kdagen::Config, (int)2>(kdagen::ChunkArgs)")
    assert ncu_lines.read_listing(lst, pat)[0][1] == "EXIT"
    import pytest

    with pytest.raises(ValueError, match="several functions"):
        ncu_lines.read_listing(lst, "chunk_kernel")
    # instances told apart by a second (bool) argument: the walk's akk form, the prologue's
    lst.write_text(".text._ZN6kdagen15prologue_kernelINS_6ConfigELb1EEEvNS_12PrologueArgsE:\n"
                   "        /*0000*/                   EXIT ;\n"
                   ".text._ZN6kdagen15prologue_kernelINS_6ConfigELb0EEEvNS_12PrologueArgsE:\n"
                   "        /*0000*/                   NOP ;\n"
                   ".text._ZN6kdagen12chunk_kernelINS_6ConfigELi0ELb1EEEvNS_9ChunkArgsE:\n"
                   "        /*0000*/                   BAR ;\n"
                   ".text._ZN6kdagen12chunk_kernelINS_6ConfigELi0ELb0EEEvNS_9ChunkArgsE:\n"
                   "        /*0000*/                   RET ;\n")
    for demangled, op in [("void kdagen::prologue_kernel<kdagen::Config, (bool)0>(kdagen::PrologueArgs)", "NOP"),
                          ("void kdagen::prologue_kernel<kdagen::Config, (bool)1>(kdagen::PrologueArgs)", "EXIT")]:
        assert ncu_lines.read_listing(lst, ncu_lines.mangled_pattern("prologue_kernel", demangled))[0][1] == op
    for demangled, op in [("void kdagen::chunk_kernel<kdagen::Config, (int)0, (bool)1>(kdagen::ChunkArgs)", "BAR"),
                          ("void kdagen::chunk_kernel<kdagen::Config, (int)0, (bool)0>(kdagen::ChunkArgs)", "RET")]:
        assert ncu_lines.read_listing(lst, ncu_lines.mangled_pattern("chunk_kernel", demangled))[0][1] == op


def test_memory_columns_sum_per_line(tmp_path):
    """--memory: shared wavefronts and L2 sectors (with their excess) per line, ranked by
    the wavefronts, divided by the launch unit given."""
    header = ["Address", "Source", "Instructions Executed", "L1 Wavefronts Shared",
              "L1 Wavefronts Shared Excessive", "L2 Theoretical Sectors Global",
              "L2 Theoretical Sectors Global Excessive"]
    rows = [["0x7f0000001000", "LDC R1, c[0x0][0x28]", "4", "0", "0", "0", "0"],
            ["0x7f0000001010", "S2R R31, SR_CTAID.X", "4", "8", "2", "0", "0"],
            ["0x7f0000001020", "@!P0 STG.E.128 desc[UR12][R14.64], R8", "4", "0", "0", "64", "32"],
            ["0x7f0000001030", "EXIT", "4", "0", "0", "0", "0"]]
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("\n".join(['"Kernel Name","prologue_kernel",""', ",".join(f'"{h}"' for h in header)]
                                   + [",".join(f'"{c}"' for c in r) for r in rows]) + "\n")
    listing = tmp_path / "listing.sass"
    listing.write_text(LISTING)
    _, got = ncu_lines.read_ncu_sass(csv_path)
    agg, bad = ncu_lines.per_line(got, ncu_lines.read_listing(listing, "prologue_kernel"))
    assert bad == 0
    assert agg[("prologue.h", 136)]["shared"] == 8 and agg[("prologue.h", 136)]["shared_excess"] == 2
    assert agg[("prologue.h", 647)]["l2"] == 64 and agg[("prologue.h", 647)]["l2_excess"] == 32
    text = ncu_lines.memory_report(agg, 2, per=4.0).splitlines()
    assert text[0] == "total: inst 4.0 shared 2.0 shared_excess 0.5 l2 16.0 l2_excess 8.0"
    assert text[1].startswith("prologue.h:136") and "shared 2.0" in text[1]


def test_a_run_of_marker_lines_is_one_inline_chain(tmp_path):
    """CUDA 13's nvdisasm writes an instruction's inline chain as a run of marker lines,
    innermost first, the kernel's own line last: the kernel-header line nearest the
    instruction counts (before, each line overwrote the last, and every inlined
    instruction counted for the kernel's call of chunk_walk)."""
    lst = tmp_path / "l.sass"
    lst.write_text(
        ".text._ZN6kdagen12chunk_kernelINS_6ConfigELi3ELb1EEEvNS_9ChunkArgsE:\n"
        '\t//## File "/x/include/kdagen/vendor_cuda.h", line 339 inlined at "/x/include/kdagen/chunk.h", line 812\n'
        '\t//## File "/x/include/kdagen/chunk.h", line 812 inlined at "/x/include/kdagen/chunk.h", line 982\n'
        '\t//## File "/x/include/kdagen/chunk.h", line 982\n'
        "        /*0000*/                   F2FP.BF16.F32.PACK_AB R96, R73, R72 ;\n"
        '\t//## File "/x/include/kdagen/chunk.h", line 894 inlined at "/x/include/kdagen/chunk.h", line 982\n'
        '\t//## File "/x/include/kdagen/chunk.h", line 982\n'
        "        /*0010*/                   UMOV UR15, 0x10 ;\n"
        "        /*0020*/                   NOP ;\n"
        '\t//## File "/x/include/kdagen/chunk.h", line 982\n'
        "        /*0030*/                   EXIT ;\n")
    got = ncu_lines.read_listing(lst, "chunk_kernel")
    assert [got[o][0] for o in (0x0, 0x10, 0x20, 0x30)] == [("chunk.h", 812), ("chunk.h", 894),
                                                            ("chunk.h", 894), ("chunk.h", 982)]
