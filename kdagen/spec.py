"""KernelSpec: the one input of the compiler, validated by pydantic.

A spec names one variant: head dim, chunk size, block width, io dtype, gate
form, fused conv width, target GPU and the ops to build. Every refusal names the
field, the value and what would be accepted.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from . import resources
from .targets import TARGETS, Target, get_target

OpName = Literal["recurrent", "prologue", "chunk"]
ALL_OPS: tuple[str, ...] = ("recurrent", "prologue", "chunk")
HEAD_DIMS = (64, 128, 256)
CHUNK_SIZES = (16, 32, 64)
CONV_WIDTHS = (0, 2, 3, 4)
GATES = ("softplus", "lower_bound")


class SpecError(ValueError):
    """A spec that cannot exist; the message says which field and why."""


class KernelSpec(BaseModel):
    """One kdagen variant. K = V = ``head_dim``; the state is always fp32."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    head_dim: Literal[64, 128, 256] = 128
    chunk_size: Literal[16, 32, 64] = 64
    block_width: int = 128
    io_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    gate: Literal["softplus", "lower_bound"] = "softplus"
    conv_width: Literal[0, 2, 3, 4] = 0
    target: str = "sm_90"
    ops: tuple[OpName, ...] = ALL_OPS

    @field_validator("head_dim", "chunk_size", "block_width", "conv_width", mode="before")
    @classmethod
    def _an_integer(cls, v: Any) -> Any:
        # pydantic's lax mode would take block_width: '64' and conv_width: false (but not
        # head_dim: '128'); a YAML integer, or a float with an integer value, is what we take
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError(f"must be an integer, got {type(v).__name__}")
        return int(v)

    @field_validator("target")
    @classmethod
    def _known_target(cls, v: str) -> str:
        get_target(v)
        return v

    @field_validator("ops")
    @classmethod
    def _ops_canonical(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError(f"must name at least one op of {', '.join(ALL_OPS)}")
        return tuple(op for op in ALL_OPS if op in v)

    @model_validator(mode="before")
    @classmethod
    def _default_block_width(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("block_width") is None:
            d = data.get("head_dim", 128)
            if isinstance(d, float) and d.is_integer():
                d = int(d)
            data = {**data, "block_width": min(128, d) if isinstance(d, int) and d > 0 else 128}
        return data

    @model_validator(mode="after")
    def _fits(self) -> "KernelSpec":
        d, c, bv = self.head_dim, self.chunk_size, self.block_width
        widths = [w for w in range(16, d + 1, 16) if d % w == 0]
        if bv not in widths:
            raise ValueError(
                f"block_width = {bv}: must be a multiple of 16 that divides head_dim ({d}); "
                f"allowed: {', '.join(map(str, widths))}"
            )
        t = self.target_info
        prefill = [op for op in self.ops if op in ("prologue", "chunk")]
        if self.conv_width and "prologue" not in self.ops:
            raise ValueError(
                f"conv_width = {self.conv_width}: the fused conv lives in the prologue; "
                "add 'prologue' to ops or set conv_width: 0"
            )
        if prefill and self.io_dtype == "fp32":
            raise ValueError(
                f"io_dtype = fp32 with ops {prefill}: the prefill kernels feed the matrix units "
                "16-bit operands; use bf16 or fp16, or build ops: [recurrent] only"
            )
        if "prologue" in self.ops:
            if c > d:
                raise ValueError(f"chunk_size = {c}: must not exceed head_dim ({d})")
            fp = resources.prologue_footprint(d, c, self.io_dtype)
            if fp.shared_mem > t.shared_mem:
                raise ValueError(
                    f"chunk_size = {c}, head_dim = {d}: the prologue needs {fp.shared_mem} bytes "
                    f"of shared memory, {t.name} has {t.shared_mem}; use a smaller chunk_size"
                )
        if "chunk" in self.ops:
            fp = resources.chunk_footprint(d, c, bv, self.io_dtype, t.wave_size)
            if fp.threads > resources.MAX_THREADS_PER_BLOCK:
                raise ValueError(
                    f"block_width = {bv}: {bv // 16} waves of {t.wave_size} is {fp.threads} "
                    f"threads, more than {resources.MAX_THREADS_PER_BLOCK}; use a smaller block_width"
                )
            waves = fp.threads // t.wave_size
            if t.wave_size == 64 and waves > resources.MAX_CHUNK_WAVES_WAVE64:
                raise ValueError(
                    f"block_width = {bv} on {t.name}: {waves} waves of 64 share a CU's four SIMDs, "
                    f"{512 * 4 // waves} registers a lane each, too few beside the chunk scan's "
                    f"state (it would spill); use block_width <= {16 * resources.MAX_CHUNK_WAVES_WAVE64}"
                )
            if fp.shared_mem > t.shared_mem:
                raise ValueError(
                    f"chunk_size = {c}, head_dim = {d}: the chunk scan needs {fp.shared_mem} bytes "
                    f"of shared memory, {t.name} has {t.shared_mem}; use a smaller chunk_size"
                )
            regs = resources.chunk_state_regs_per_lane(d, t.wave_size)
            if regs > resources.MAX_STATE_REGS_PER_LANE:
                raise ValueError(
                    f"head_dim = {d} on {t.name}: the chunk scan would keep {regs} fp32 state "
                    f"values per lane (at most {resources.MAX_STATE_REGS_PER_LANE} fit beside "
                    "its accumulators); build ops: [recurrent] for this head dim"
                )
        return self

    # ---- derived facts -------------------------------------------------------------

    @property
    def target_info(self) -> Target:
        return TARGETS[self.target]

    def canonical(self) -> dict[str, Any]:
        """Every field, defaults resolved: the spec's identity."""
        return json.loads(self.model_dump_json())

    @property
    def content_hash(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def name(self) -> str:
        """Readable variant name, e.g. ``kda_d128_c64_bv128_bf16_gfx942``."""
        parts = [
            "kda",
            f"d{self.head_dim}",
            f"c{self.chunk_size}",
            f"bv{self.block_width}",
            self.io_dtype,
        ]
        if self.gate == "lower_bound":
            parts.append("lb")
        if self.conv_width:
            parts.append(f"conv{self.conv_width}")
        if self.ops != ALL_OPS:
            parts.append("ops_" + "_".join(op[:3] for op in self.ops))
        parts.append(self.target_info.tag)
        return "_".join(parts)

    @property
    def uri(self) -> str:
        """Name plus short content hash: names source and build folders."""
        return _uri(self)

    def with_target(self, target: str) -> "KernelSpec":
        return KernelSpec.parse({**self.canonical(), "target": target})

    # ---- loading ---------------------------------------------------------------------

    @classmethod
    def parse(cls, data: Any, source: str = "spec") -> "KernelSpec":
        """Validate a mapping, with a one-paragraph :class:`SpecError` on refusal."""
        if isinstance(data, KernelSpec):
            return data
        if not isinstance(data, dict):
            raise SpecError(f"{source}: a spec is a mapping of fields, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(_describe(e, source)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "KernelSpec":
        path = Path(path)
        return cls.parse(load_yaml(path), source=str(path))


def load_yaml(path: Path) -> Any:
    """Read a YAML file with errors that name the file and line."""
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a UTF-8 text file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.reader.ReaderError as e:  # a character YAML does not allow: no mark, a position
        pos = int(getattr(e, "position", 0))
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        raise SpecError(f"{path}: line {line}, column {col}: malformed YAML: "
                        f"{e.reason} character {e.character!r}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f": line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{path}{where}: malformed YAML: {problem}") from None
    except RecursionError:
        raise SpecError(f"{path}: malformed YAML: nested too deeply") from None
    except Exception as e:  # PyYAML's constructors raise ValueError, KeyError, ... on bad tags
        raise SpecError(f"{path}: malformed YAML: {type(e).__name__}: {e}") from None
    return {} if data is None else data


def _describe(err: ValidationError, source: str) -> str:
    known = ", ".join(KernelSpec.model_fields)
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not field:  # a whole-spec check: its message names the fields
            lines.append(msg)
            continue
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown field {field!r}; known fields: {known}")
            continue
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"field {field!r}{shown}: {msg}")
    return f"{source}: invalid spec: " + "; ".join(lines)


def parse_gates(text: str, flag: str = "--gates") -> list[str]:
    """A comma-separated list of gate forms (GATES); ValueError naming ``flag`` for an
    empty list or an unknown form."""
    gates = [g.strip() for g in text.split(",") if g.strip()]
    if not gates or any(g not in GATES for g in gates):
        raise ValueError(f"{flag} {text!r}: name {' and / or '.join(GATES)}, comma separated")
    return gates


def spec_with_target(spec: "KernelSpec | dict | str | Path | None", target: str) -> KernelSpec:
    """``spec`` (a spec object, a mapping, a YAML path; None: the default spec) validated
    for ``target``, the target replaced before validation: a file whose own target could
    not take it (head_dim 256 on sm_90, the default) is judged on ``target`` alone."""
    if isinstance(spec, KernelSpec):
        fields, source = spec.canonical(), "spec"
    elif isinstance(spec, (str, Path)):
        fields, source = load_yaml(Path(spec)), str(spec)
    else:
        fields, source = ({} if spec is None else spec), "spec"
    if not isinstance(fields, dict):
        return KernelSpec.parse(fields, source=source)  # refused: not a mapping
    return KernelSpec.parse({**fields, "target": target}, source=source)


def spec_from_any(spec: "KernelSpec | dict | str | Path") -> KernelSpec:
    """Accept a spec object, a mapping or a YAML path."""
    if isinstance(spec, KernelSpec):
        return spec
    if isinstance(spec, (str, Path)):
        return KernelSpec.from_yaml(spec)
    return KernelSpec.parse(spec)


@functools.lru_cache(maxsize=1024)
def _uri(spec: KernelSpec) -> str:
    """A spec's uri, once per field set (specs are frozen, hashed and compared by their
    fields; ``load``'s fast path asks on every call)."""
    return f"{spec.name}-{spec.content_hash[:8]}"
