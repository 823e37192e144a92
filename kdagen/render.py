"""Render a spec into HIP sources: kernels.hip, binding.cpp and the headers.

Jinja2 with StrictUndefined; the spec is the only input, so the same spec always
renders byte-identical files. Templates set constants and pick the vendor layer;
the kernel logic lives in ordinary headers under ``templates/include/kdagen``,
which are copied beside the rendered sources so a rendered folder is
self-contained and readable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from . import __version__, resources
from .spec import KernelSpec

IO_ENUM = {"bf16": "kBF16", "fp16": "kFP16", "fp32": "kFP32"}
OP_STRUCTS = {"recurrent": "RecurrentArgs", "prologue": "PrologueArgs", "chunk": "ChunkArgs"}
KERNEL_SOURCE = "kernels.hip"
BINDING_SOURCE = "binding.cpp"


def templates_dir() -> Path:
    """The template folder: inside the installed package, or the repo's own."""
    here = Path(__file__).resolve().parent
    for cand in (here / "templates", here.parent / "templates"):
        if (cand / "kernels.hip.j2").is_file():
            return cand
    raise FileNotFoundError(f"kdagen templates not found beside {here}")


def header_files() -> dict[str, str]:
    """Headers by path relative to the include root, e.g. ``kdagen/chunk.h``."""
    root = templates_dir() / "include"
    return {
        p.relative_to(root).as_posix(): p.read_text()
        for p in sorted(root.rglob("*.h"))
    }


def templates_digest() -> str:
    """Hash of every template and header: part of each build's cache key."""
    h = hashlib.sha256()
    root = templates_dir()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".j2", ".h"):
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def _env(root: str) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(root),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


@dataclass(frozen=True)
class Rendered:
    """The sources of one variant, by relative path."""

    spec: KernelSpec
    files: dict[str, str]

    def digest(self) -> str:
        """SHA-256 of every rendered file (paths and contents): what a build compiles."""
        h = hashlib.sha256()
        for rel in sorted(self.files):
            h.update(rel.encode() + b"\0" + self.files[rel].encode() + b"\0")
        return h.hexdigest()

    def write(self, folder: Path, extra_source: str = "") -> list[Path]:
        """Write into ``folder`` (created), only rewriting files that changed.
        ``extra_source`` (probes and tests) goes at the end of the kernel source, where it
        sees the variant's Config and headers."""
        written = []
        for rel, text in self.files.items():
            if rel == KERNEL_SOURCE:
                text += extra_source
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.read_text() != text:
                path.write_text(text)
            written.append(path)
        return written


def symbol_prefix(spec: KernelSpec) -> str:
    return f"kdagen_{spec.name}"


def chunk_plan_for(spec: KernelSpec) -> resources.ChunkPlan:
    """How this variant's chunk scan buffers its operands on its target."""
    t = spec.target_info
    return resources.chunk_plan(spec.head_dim, spec.chunk_size, spec.block_width, spec.io_dtype,
                                t.wave_size, t.shared_mem, t.async_copy, t.cu_smem,
                                t.block_smem_reserve, t.warpgroup_mma,
                                resources.chunk_swizzle(t.vendor, spec.chunk_size),
                                resources.pass_one_swizzle(t.vendor, spec.chunk_size))


def render(spec: KernelSpec) -> Rendered:
    """Render every source of ``spec``."""
    t = spec.target_info
    prologue_swizzle = resources.prologue_swizzle(t.vendor, spec.head_dim, spec.chunk_size,
                                                  spec.io_dtype, t.shared_mem)
    prologue_bytes = resources.prologue_shared_mem(spec.head_dim, spec.chunk_size, spec.io_dtype,
                                                   t.shared_mem, prologue_swizzle)
    ctx = dict(
        spec=spec,
        spec_items=sorted(spec.canonical().items()),
        name=spec.name,
        symbol=symbol_prefix(spec),
        target=t,
        vendor_header="vendor_cuda.h" if t.vendor == "nvidia" else "vendor_cdna.h",
        io_enum=IO_ENUM[spec.io_dtype],
        stage_q=resources.prologue_stages_q(spec.head_dim, spec.chunk_size, spec.io_dtype,
                                            t.shared_mem),
        planar=resources.prologue_planar(spec.head_dim, spec.chunk_size, spec.io_dtype,
                                         t.shared_mem),
        prologue_bytes=prologue_bytes,
        prologue_swizzle=prologue_swizzle,
        prologue_min_blocks=resources.prologue_min_blocks(
            prologue_bytes, t.cu_smem, t.block_smem_reserve,
            resources.prologue_threads(spec.chunk_size)),
        chunk=chunk_plan_for(spec),
        chunk_u_apart=resources.CHUNK_U_APART,
        pass_one_lead=resources.PASS_ONE_LEAD,
        pad16=resources.PAD_16BIT,
        pad32=resources.PAD_FP32,
        recurrent_rows=resources.RECURRENT_ROWS_PER_BLOCK,
        recurrent_waves=resources.RECURRENT_WAVES,
        prologue_threads=resources.prologue_threads(spec.chunk_size),
        scan_threads=resources.SCAN_THREADS,
        scan_plans=resources.scan_plans(spec.head_dim),
        op_structs=OP_STRUCTS,
        kdagen_version=__version__,
    )
    env = _env(str(templates_dir()))
    files = {
        KERNEL_SOURCE: env.get_template("kernels.hip.j2").render(ctx),
        BINDING_SOURCE: env.get_template("binding.cpp.j2").render(ctx),
    }
    for rel, text in header_files().items():
        files[f"include/{rel}"] = text
    return Rendered(spec, files)
