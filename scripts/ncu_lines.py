"""Per-source-line totals of an Nsight Compute SASS profile:

    python3 scripts/ncu_lines.py sass.csv[.gz] listing.sass prologue_kernel [top]
    python3 scripts/ncu_lines.py --memory sass.csv[.gz] listing.sass prologue_kernel [top]
    python3 scripts/ncu_lines.py --listing OUT.sass shape gate chunk width   (writes the listing)

`sass.csv` is `ncu -i rep --page source --csv --print-source sass` (one row per SASS
instruction: address, text, instructions executed, stall samples by reason); it carries
no source lines. `listing.sass` is `nvdisasm -gi` of a cubin compiled from the same source
with the same nvcc and flags plus -lineinfo (which leaves the code as it is): its
`//## File ..., line N` markers name the template line of every instruction offset (the
csv's kernel name picks the instance: the chunk scan's three modes). The
two are joined by the offset from the kernel's first instruction; rows whose opcodes
disagree are counted (a different compiler or flag shows up there). `--memory` ranks the
lines by shared-memory wavefronts instead, with their L2 sectors and the excess of both
(what the csv of `--set full` carries), per launch unit given as [per] (default 1).
"""

from __future__ import annotations

import collections
import csv
import gzip
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

Line = tuple[str, int]  # (file name, line)


def _open(path: str | Path):
    return gzip.open(path, "rt", errors="replace") if str(path).endswith(".gz") else open(path, errors="replace")


def read_ncu_sass(path: str | Path) -> tuple[str, list[dict[str, str]]]:
    """The kernel's (demangled) name and the instruction rows of an ncu SASS-page csv, as
    dicts keyed by its header."""
    name, header, rows = "", None, []
    with _open(path) as f:
        for r in csv.reader(f):
            if r[:1] == ["Kernel Name"] and len(r) > 1:
                name = r[1]
            elif "Address" in r and "Source" in r:
                header = r
            elif header is not None and len(r) == len(header):
                rows.append(dict(zip(header, r)))
    return name, rows


def mangled_pattern(kernel: str, demangled: str) -> str:
    """What names ``kernel``'s instance in the listing from ncu's demangled name: its
    template arguments after the Config, ``(int)2`` -> ``Li2E`` and ``(bool)1`` -> ``Lb1E``
    (``chunk_kernel<kdagen::Config, (int)2, (bool)1>`` is ``chunk_kernelINS_6ConfigELi2ELb1E``,
    ``prologue_kernel<kdagen::Config, (bool)0>`` is ``prologue_kernelINS_6ConfigELb0E``)."""
    m = re.search(rf"{re.escape(kernel)}<kdagen::Config((?:, \((?:int|bool)\)\d+|, \d+)*)>", demangled)
    if not m or not m.group(1):
        return kernel
    args = re.findall(r"(?:\((int|bool)\))?(\d+)", m.group(1))
    return f"{kernel}INS_6ConfigE" + "".join(f"L{'b' if t == 'bool' else 'i'}{v}E" for t, v in args)


# Helpers inlined into the kernels: an instruction of theirs counts for the kernel line
# that (through any chain of inlined calls) reached them.
HELPER_FILES = ("numeric.h", "vendor_cuda.h", "vendor_cdna.h", "platform.h", "hip_on_cuda.h", "emulate.h")


def _kernel_line(marker: str) -> Line:
    """The innermost location of an `nvdisasm -gi` marker (`//## File "a", line 3 inlined
    at "b", line 7 ...`) that lies in a kernel header (not a helper nor a CUDA header);
    the innermost location where there is none."""
    chain = [(f.rsplit("/", 1)[-1], int(n), f) for f, n in re.findall(r'"([^"]+)", line (\d+)', marker)]
    for name, line, full in chain:
        if "/kdagen/" in full and name not in HELPER_FILES:
            return name, line
    return (chain[0][0], chain[0][1]) if chain else ("?", 0)


def read_listing(path: str | Path, kernel: str) -> dict[int, tuple[Line, str]]:
    """Offset -> ((file, line), opcode) for the functions whose mangled name holds `kernel`.
    An instruction's marker is one line with the whole chain (older nvdisasm) or a run of
    lines, one a level, innermost first (CUDA 13's): a run is read as one chain."""
    out: dict[int, tuple[Line, str]] = {}
    inside, cur, seen, run = False, ("?", 0), [], []
    with open(path, errors="replace") as f:
        for ln in f:
            if ln.startswith(".text."):
                inside = kernel in ln
                if inside:
                    seen.append(ln.strip())
                    if len(seen) > 1:
                        raise ValueError(f"{kernel!r} names several functions: {seen}")
                cur, run = ("?", 0), []
                continue
            if not inside:
                continue
            if "//## File" in ln:
                run.append(ln.strip())
                continue
            if run:
                cur, run = _kernel_line(" ".join(run)), []
            m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
            if m:
                out[int(m.group(1), 16)] = (cur, m.group(2))
    return out


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(sass: str) -> str:
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0] if words else ""


# The SASS page's memory columns that --memory sums per line, and their short names.
MEMORY = {
    "L1 Wavefronts Shared": "shared",
    "L1 Wavefronts Shared Excessive": "shared_excess",
    "L2 Theoretical Sectors Global": "l2",
    "L2 Theoretical Sectors Global Excessive": "l2_excess",
}


def per_line(rows: list[dict[str, str]], listing: dict[int, tuple[Line, str]]
             ) -> tuple[dict[Line, collections.Counter], int]:
    """Sums per source line of instructions executed, stall samples and each stall reason;
    and how many rows did not match the listing's opcode at their offset."""
    if not rows:
        return {}, 0
    base = int(rows[0]["Address"], 16)
    reasons = [c for c in rows[0] if c.startswith("stall_") and "(Not Issued)" not in c]
    agg: dict[Line, collections.Counter] = collections.defaultdict(collections.Counter)
    mismatched = 0
    for r in rows:
        line, op = listing.get(int(r["Address"], 16) - base, (("?", 0), ""))
        if op != _opcode(r["Source"]):
            mismatched += 1
        a = agg[line]
        a["inst"] += _num(r.get("Instructions Executed", "0"))
        a["samples"] += _num(r.get("Warp Stall Sampling (All Samples)", "0"))
        for c in reasons:
            a[c[len("stall_"):]] += _num(r[c])
        for c, short in MEMORY.items():
            a[short] += _num(r.get(c, "0"))
    return dict(agg), mismatched


def report(agg: dict[Line, collections.Counter], top: int = 40) -> str:
    """The `top` lines by stall samples: share of samples and of instructions, and each
    line's three largest stall reasons per sample."""
    ti = sum(a["inst"] for a in agg.values()) or 1.0
    ts = sum(a["samples"] for a in agg.values()) or 1.0
    out = [f"instructions {ti:.4g}, stall samples {ts:.4g}"]
    for (name, line), a in sorted(agg.items(), key=lambda kv: -kv[1]["samples"])[:top]:
        why = sorted(((v, k) for k, v in a.items() if k not in ("inst", "samples")), reverse=True)[:3]
        out.append(f"{name}:{line:<5d} samples {100 * a['samples'] / ts:5.1f}%  inst {100 * a['inst'] / ti:5.1f}%  "
                   + " ".join(f"{k} {v / max(a['samples'], 1.0):.2f}" for v, k in why))
    return "\n".join(out)


def memory_report(agg: dict[Line, collections.Counter], top: int = 40, per: float = 1.0) -> str:
    """The `top` lines by shared-memory wavefronts: instructions, wavefronts and L2 sectors
    (each with its excess) per `per` (the launch's blocks, say, for per-block figures)."""
    tot = collections.Counter()
    for a in agg.values():
        tot.update({k: a[k] for k in ("inst", *MEMORY.values())})
    fmt = lambda a: " ".join(f"{k} {a[k] / per:.1f}" for k in ("inst", *MEMORY.values()))  # noqa: E731
    out = [f"total: {fmt(tot)}"]
    for (name, line), a in sorted(agg.items(), key=lambda kv: -kv[1]["shared"])[:top]:
        out.append(f"{name}:{line:<5d} {fmt(a)}")
    return "\n".join(out)


def compile_listing(spec, out: Path) -> Path:
    """`nvdisasm -gi` of ``spec``'s kernels compiled as the build compiles them (kdagen's
    nvcc command, -lineinfo added, a cubin instead of an object) into ``out``."""
    from kdagen.render import render
    from kdagen.toolchain import device_compiler

    dev = device_compiler(spec.target_info)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        render(spec).write(src)
        cmd = dev.compile_command(str(src / "kernels.hip"), str(src / "k.o"), str(src / "include"),
                                  str(src / "k.d"))
        i = cmd.index("-c")
        cmd = [a for a in cmd[:i] if a not in ("-MD", "-MF", str(src / "k.d"))] + ["-lineinfo", "-cubin",
                                                                                   str(src / "kernels.hip"),
                                                                                   "-o", str(src / "k.cubin")]
        subprocess.run(cmd, check=True, capture_output=True)
        nvdisasm = shutil.which("nvdisasm") or str(Path(dev.path).resolve().parent / "nvdisasm")
        out.write_text(subprocess.run([nvdisasm, "-gi", str(src / "k.cubin")], check=True,
                                      capture_output=True, text=True).stdout)
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 1 and argv[1] == "--listing":
        from kdagen.spec import KernelSpec
        from kdagen.targets import TARGETS

        target = next(t for t in TARGETS.values() if t.vendor == "nvidia").name
        shape, gate, chunk, width = argv[3:7]
        del shape  # (the kernels do not depend on it; kept so the profile arguments pass through)
        spec = KernelSpec.parse({"target": target, "gate": gate, "chunk_size": int(chunk),
                                 "block_width": int(width)})
        print(compile_listing(spec, Path(argv[2])))
        return 0
    memory = len(argv) > 1 and argv[1] == "--memory"
    if memory:
        argv = argv[:1] + argv[2:]
    if len(argv) < 4:
        print(__doc__)
        return 2
    name, rows = read_ncu_sass(argv[1])
    listing = read_listing(argv[2], mangled_pattern(argv[3], name))
    agg, bad = per_line(rows, listing)
    print(f"{len(rows)} SASS rows, {bad} not matching the listing")
    top = int(argv[4]) if len(argv) > 4 else 40
    if memory:
        print(memory_report(agg, top, float(argv[5]) if len(argv) > 5 else 1.0))
    else:
        print(report(agg, top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
