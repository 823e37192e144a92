"""The GPUs kdagen generates code for, with the facts codegen needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Target:
    """One GPU architecture.

    ``shared_mem`` is the most LDS / shared memory one workgroup may use (bytes),
    ``check_arch`` the arch a compile-only check falls back to when the local
    compiler does not know ``arch`` (Debian's ROCm 5.2 clang stops at gfx940),
    ``async_copy`` whether kernels may double-buffer through asynchronous copies,
    ``cu_shared_mem`` the LDS / shared memory of one compute unit (SM) that resident
    workgroups share, ``block_smem_reserve`` what the hardware keeps per resident
    workgroup out of it (1 KB on Hopper), ``warpgroup_mma`` whether four warps can issue
    one matrix product with its B operand read from shared memory (wgmma, sm_90a).
    """

    name: str
    vendor: Literal["amd", "nvidia"]
    arch: str
    wave_size: int
    shared_mem: int
    matrix: Literal["mfma", "mma.sync"]
    description: str
    check_arch: str | None = None
    async_copy: bool = False  # 16-byte asynchronous global -> shared copies (cp.async)
    cu_shared_mem: int = 0  # 0: the same as shared_mem
    block_smem_reserve: int = 0
    warpgroup_mma: bool = False

    @property
    def cu_smem(self) -> int:
        """LDS / shared memory per compute unit (bytes)."""
        return self.cu_shared_mem or self.shared_mem

    @property
    def tag(self) -> str:
        """Short form used in variant names (``sm_90`` -> ``sm90``)."""
        return self.name.replace("_", "")


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("gfx90a", "amd", "gfx90a", 64, 65536, "mfma", "AMD Instinct MI200 (CDNA2)"),
        Target(
            "gfx942", "amd", "gfx942", 64, 65536, "mfma", "AMD Instinct MI300 (CDNA3)",
            check_arch="gfx940",
        ),
        Target(
            "gfx950", "amd", "gfx950", 64, 163840, "mfma", "AMD Instinct MI350 (CDNA4)",
            check_arch="gfx940",
        ),
        Target("sm_90", "nvidia", "sm_90a", 32, 232448, "mma.sync", "NVIDIA Hopper (H100, H200)",
               async_copy=True, cu_shared_mem=233472, block_smem_reserve=1024, warpgroup_mma=True),
    )
}


def get_target(name: str) -> Target:
    """Look a target up by name, with an error that lists the known ones."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(
            f"unknown target {name!r}; known targets: {', '.join(TARGETS)}"
        ) from None
