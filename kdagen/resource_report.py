"""What the compiler gave each kernel of a built variant: registers, spills, shared memory.

NVIDIA: ``cuobjdump -res-usage`` of the object (REG, LOCAL = spill / stack bytes a
thread, SHARED = static shared memory). AMD: the code object's metadata notes
(``objcopy`` the fat binary out, ``clang-offload-bundler`` the device code,
``llvm-readelf --notes``): ``.vgpr_count`` (VGPRs and AGPRs together on gfx90a / gfx940),
``.private_segment_fixed_size`` (scratch bytes a lane), ``.group_segment_fixed_size``
(static LDS). Dynamic shared memory (the prologue's and the walks' planes) is sized at
launch and not in either: the spec's validator accounts for it (``resources.py``); on
NVIDIA the static figure includes the 1 KB a block's system reserve takes.

``kdagen build --report`` prints this after the build; a kernel that spills is flagged.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml


class ReportError(RuntimeError):
    """A disassembler is missing or failed."""


class ToolMissing(ReportError):
    """A disassembler is not installed (the others: it ran and failed)."""


@dataclass(frozen=True)
class KernelResources:
    kernel: str          # the kernel's name, demangled and shortened
    registers: int       # per thread / lane (AMD: VGPRs and AGPRs)
    spill_bytes: int     # local memory (NVIDIA) or scratch (AMD) per thread / lane
    static_shared: int   # static shared memory / LDS per block, bytes

    @property
    def spills(self) -> bool:
        return self.spill_bytes > 0


def find_tool(*names: str) -> str | None:
    """The first of ``names`` on PATH, or given as an absolute path, that is executable."""
    for n in names:
        if os.path.isabs(n):
            if os.path.isfile(n) and os.access(n, os.X_OK):
                return n
        elif shutil.which(n):
            return shutil.which(n)
    return None


def cuobjdump() -> str | None:
    """cuobjdump: KDAGEN_CUOBJDUMP, PATH, beside nvcc, /usr/local/cuda, or PyPI's
    nvidia-cuda-cuobjdump (scripts/setup.sh installs it where the toolkit lacks one)."""
    cands = [os.environ.get("KDAGEN_CUOBJDUMP") or "", "cuobjdump"]
    try:
        from .toolchain import find_nvcc

        nvcc = Path(find_nvcc())
        cands += [str(nvcc.parent / "cuobjdump"), str(nvcc.resolve().parent / "cuobjdump")]
    except Exception:  # no nvcc: the other places may still have one
        pass
    cands.append("/usr/local/cuda/bin/cuobjdump")
    try:
        import nvidia

        cands += [str(p) for root in nvidia.__path__ for p in sorted(Path(root).glob("*/bin/cuobjdump"))]
    except ImportError:
        pass
    return find_tool(*[c for c in cands if c])


def _short(symbol: str) -> str:
    """A kernel's name without its namespace, Config and argument struct."""
    try:
        name = subprocess.run(["c++filt", symbol], capture_output=True, text=True).stdout.strip()
    except OSError:
        name = symbol
    name = name or symbol
    for cut in ("kdagen::", "(kdagen::ChunkArgs)", "(kdagen::PrologueArgs)", "(kdagen::RecurrentArgs)",
                "(ChunkArgs)", "(PrologueArgs)", "(RecurrentArgs)"):
        name = name.replace(cut, "")
    return name.replace("void ", "")


_FUNC = re.compile(r"^\s*Function (\S+):\s*$")
_USAGE = re.compile(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)")
_STACK = re.compile(r"STACK:(\d+)")


def parse_cuobjdump(text: str) -> list[KernelResources]:
    """``cuobjdump -res-usage`` output -> one row per function (spills: LOCAL and STACK)."""
    rows, name = [], None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            continue
        u = _USAGE.search(line)
        if u and name:
            stack = _STACK.search(line)
            spill = int(u.group(3)) + (int(stack.group(1)) if stack else 0)
            rows.append(KernelResources(_short(name), int(u.group(1)), spill, int(u.group(2))))
            name = None
    return rows


def parse_amd_notes(text: str) -> list[KernelResources]:
    """``llvm-readelf --notes`` of an AMD code object -> one row per kernel."""
    m = re.search(r"^\s*---\n(.*?)^\.\.\.", text, re.S | re.M)
    if m is None:
        raise ReportError("no AMDGPU metadata in the code object's notes")
    doc = yaml.safe_load(m.group(1))
    return [KernelResources(_short(k[".name"]), int(k[".vgpr_count"]),
                            int(k[".private_segment_fixed_size"]), int(k[".group_segment_fixed_size"]))
            for k in doc.get("amdhsa.kernels", [])]


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ReportError(f"{Path(cmd[0]).name} failed: {(r.stderr or r.stdout).strip()[:400]}")
    return r.stdout


def nvidia_resources(obj: Path) -> list[KernelResources]:
    tool = cuobjdump()
    if tool is None:
        raise ToolMissing("cuobjdump not found (PATH, beside nvcc, /usr/local/cuda/bin, "
                          "KDAGEN_CUOBJDUMP, or `pip install nvidia-cuda-cuobjdump`)")
    return parse_cuobjdump(_run([tool, "-res-usage", str(obj)]))


def amd_code_object(obj: Path, arch: str, folder: Path) -> Path:
    """The ``arch`` device code object inside the HIP object file ``obj``, unbundled into
    ``folder`` (``objcopy`` the fat binary out, then ``clang-offload-bundler``)."""
    objcopy = find_tool("objcopy", "llvm-objcopy-15", "llvm-objcopy", "/opt/rocm/llvm/bin/llvm-objcopy")
    bundler = find_tool("clang-offload-bundler-15", "clang-offload-bundler",
                        "/opt/rocm/llvm/bin/clang-offload-bundler")
    if not (objcopy and bundler):
        raise ToolMissing("objcopy and clang-offload-bundler are needed (ROCm's llvm, or Debian's "
                          "clang-tools-15 / llvm-15)")
    fat, dev = folder / "fat", folder / "dev.co"
    # an output file is a must: without one objcopy rewrites the cached object in place
    _run([objcopy, "--dump-section", f".hip_fatbin={fat}", str(obj), str(folder / "scratch.o")])
    bundles = [b for b in _run([bundler, "--list", "--type=o", f"--input={fat}"]).split()
               if b.startswith("hip") and b.rsplit("--", 1)[-1].split(":")[0] == arch]
    if len(bundles) != 1:
        raise ReportError(f"no single {arch} device bundle in {obj}")
    _run([bundler, "--unbundle", "--type=o", f"--input={fat}", f"--targets={bundles[0]}",
          f"--output={dev}"])
    return dev


def amd_resources(obj: Path, arch: str) -> list[KernelResources]:
    readelf = find_tool("llvm-readelf-15", "llvm-readelf", "/opt/rocm/llvm/bin/llvm-readelf")
    if readelf is None:
        raise ToolMissing("llvm-readelf is needed (ROCm's llvm, or Debian's llvm-15)")
    with tempfile.TemporaryDirectory() as tmp:
        dev = amd_code_object(obj, arch, Path(tmp))
        return parse_amd_notes(_run([readelf, "--notes", str(dev)]))


def entry_resources(entry) -> list[KernelResources]:
    """The rows of a built cache entry (``kdagen.build.Entry``), by its vendor."""
    arch = (entry.manifest() or {}).get("arch") or entry.device.arch
    if entry.spec.target_info.vendor == "nvidia":
        return nvidia_resources(entry.kernels_object)
    return amd_resources(entry.kernels_object, arch)


def format_report(name: str, rows: list[KernelResources]) -> str:
    """A table of ``rows`` under the variant's name; spilling kernels marked."""
    width = max([len(r.kernel) for r in rows] + [6])
    out = [f"{name}: registers, spills and static shared memory per kernel",
           f"  {'kernel':{width}}  regs  spill B  static shared B"]
    for r in rows:
        mark = "  <- spills" if r.spills else ""
        out.append(f"  {r.kernel:{width}}  {r.registers:4d}  {r.spill_bytes:7d}  {r.static_shared:15d}{mark}")
    return "\n".join(out)
