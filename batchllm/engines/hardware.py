"""What makes a profile's numbers true of a machine: its hardware identity.

A CPU is identified by its model name and the ISA features that select vLLM's CPU kernels
(AVX2, AVX-512, AVX512-BF16, AMX), plus the engine dtype that follows from them; a GPU by
its name and memory (the count is recorded: it bounds the shapes a profile could measure,
but does not change a replica's speed, so it is not compared). A field that is None is
unknown (a profile written before identities were recorded).

Invariant: `differences(a, b)` is empty exactly when nothing that changes step times
differs between `a` and `b` (or, for an unknown field, could differ); each line names
one difference, profile side first. CPU names compare by their slug (`Intel(R) Xeon(R) CPU
@ 2.20GHz` and `Intel Xeon` are the same CPU kind); GPU names by their model alone, vendor,
form factor and memory size dropped (`NVIDIA A100-SXM4-80GB` is an `A100-80G`), since the
memory is compared on its own.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchllm.core.errors import UserError

# The /proc/cpuinfo flags that select vLLM's CPU kernels, in the order they are reported.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
# Stands for the CPU's kernel flags when set (comma-separated: "avx2" makes an AVX-512 host run and
# file profiles as an AVX2-only one would: float32 engines). For checking the other kind of host.
CPU_FLAGS_ENV = "BATCHLLM_CPU_FLAGS"
# What profiles record for "the model's own dtype" (every model served here is bfloat16).
MODEL_DTYPE = "bfloat16"
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class HardwareIdentity:
    kind: str  # "cpu" or "gpu"
    name: str | None  # CPU model name from /proc/cpuinfo, or GPU name from nvidia-smi
    dtype: str | None = None  # the engines' weights dtype on this hardware
    cpu_flags: tuple[str, ...] | None = None  # the KERNEL_FLAGS present, in KERNEL_FLAGS order
    gpu_memory_mib: int | None = None
    gpu_count: int | None = None

    @property
    def folder_name(self) -> str:
        """The profile folder this hardware files under: `cpu-amd-epyc`, `gpu-nvidia-a100-sxm4-80gb`."""
        return f"{self.kind}-{name_slug(self.name or 'unknown')}"

    def describe(self) -> str:
        if self.kind == "gpu":
            count = f"{self.gpu_count}x " if self.gpu_count else ""
            memory = f"{self.gpu_memory_mib} MiB, " if self.gpu_memory_mib else ""
            return f"{count}{self.name or 'unknown GPU'} ({memory}engines {self.dtype or 'unknown dtype'})"
        flags = "flags unknown" if self.cpu_flags is None else ", ".join(self.cpu_flags) or f"none of {', '.join(KERNEL_FLAGS)}"
        return f"{self.name or 'unknown CPU'} ({flags}; engines {self.dtype or 'unknown dtype'})"

    def to_dict(self) -> dict[str, object]:
        body: dict[str, object] = {"kind": self.kind, "name": self.name, "dtype": self.dtype}
        if self.kind == "cpu":
            body["cpu_flags"] = None if self.cpu_flags is None else list(self.cpu_flags)
        else:
            body.update(gpu_memory_mib=self.gpu_memory_mib, gpu_count=self.gpu_count)
        return {key: value for key, value in body.items() if value is not None}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> HardwareIdentity:
        flags = body.get("cpu_flags")
        return cls(str(body["kind"]), body.get("name"), body.get("dtype"),
                   None if flags is None else tuple(f for f in KERNEL_FLAGS if f in flags),
                   body.get("gpu_memory_mib"), body.get("gpu_count"))


def name_slug(name: str) -> str:
    """`Intel(R) Xeon(R) CPU @ 2.20GHz` -> `intel-xeon`: vendor marks, 'CPU', 'processor' and clock dropped."""
    slug = re.sub(r"\(r\)|\(tm\)|\bcpu\b|@.*|processor", " ", name.lower())
    return "-".join(re.findall(r"[a-z0-9]+", slug))


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bfloat16 arithmetic in hardware


def cpu_engine_dtype(flags: tuple[str, ...] | None) -> str | None:
    """The dtype CPU engines must use, None for the model's own (bfloat16 for the embedded
    model). Without bfloat16 arithmetic in hardware, bfloat16 weights cost conversions on every
    matmul: float32 was faster wherever measured. Without AVX-512 vLLM falls back to plain torch
    (prefill 4.6x slower than float32 on an AMD EPYC with AVX2 only); with AVX-512 but no BF16 (an
    Intel Xeon whose VM hides avx512_bf16 and AMX) float32 ran 12 chats' prefill and 16 tokens
    3.1x and 4 chats' 128-token decode 1.7x faster on one core
    (benchmarks/results/cpu-dtype-2026-12-07-avx512-no-bf16.txt). Unknown flags keep the model's own."""
    return None if flags is None or any(flag in flags for flag in BF16_FLAGS) else "float32"


def parse_cpuinfo(text: str) -> HardwareIdentity:
    """The identity in a /proc/cpuinfo text (its first processor's `model name` and `flags`)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = None if "flags" not in fields else tuple(f for f in KERNEL_FLAGS if f in fields["flags"].split())
    return HardwareIdentity("cpu", fields.get("model name") or None, cpu_engine_dtype(flags) or MODEL_DTYPE, flags)


def seen_with_flags(here: HardwareIdentity, listing: str) -> HardwareIdentity:
    """`here` with the kernel flags of `listing` (comma-separated, e.g. "avx2"), and the engine dtype they select."""
    words = {word.strip() for word in listing.split(",") if word.strip()}
    unknown = sorted(words - set(KERNEL_FLAGS))
    if unknown:
        raise UserError(f"{listing!r} names {', '.join(unknown)}, not a CPU kernel flag", where=CPU_FLAGS_ENV,
                        hint=f"use a comma-separated list of {', '.join(KERNEL_FLAGS)} (e.g. avx2), or unset it")
    flags = tuple(f for f in KERNEL_FLAGS if f in words)
    return replace(here, cpu_flags=flags, dtype=cpu_engine_dtype(flags) or MODEL_DTYPE)


def parse_nvidia_smi(text: str) -> HardwareIdentity:
    """The identity in `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`
    output: one line per GPU, `NVIDIA A100-SXM4-80GB, 81920`. The first GPU names the kind."""
    rows = [[cell.strip() for cell in line.rsplit(",", 1)] for line in text.splitlines() if line.strip()]
    if not rows or any(len(row) != 2 or not row[1].isdigit() for row in rows):
        raise ValueError(f"unexpected nvidia-smi output {text[:200]!r}")
    return HardwareIdentity("gpu", rows[0][0], MODEL_DTYPE, gpu_memory_mib=int(rows[0][1]), gpu_count=len(rows))


@functools.cache  # the hardware does not change while batchllm runs
def this_machine(kind: str) -> HardwareIdentity:
    """This machine's CPU (from /proc/cpuinfo) or GPUs (from nvidia-smi). `CPU_FLAGS_ENV`, when
    set, stands for the CPU's kernel flags: a host seen as another kind would see it."""
    if kind == "cpu":
        try:
            here = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
        except OSError:
            here = HardwareIdentity("cpu", None, MODEL_DTYPE)
        return here if CPU_FLAGS_ENV not in os.environ else seen_with_flags(here, os.environ[CPU_FLAGS_ENV])
    if not shutil.which("nvidia-smi"):
        raise UserError("no GPU here: nvidia-smi is not on the PATH", where="--devices", hint="use cpu:N, or install the NVIDIA driver")
    try:
        output = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=10, check=True).stdout
        return parse_nvidia_smi(output)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        raise UserError(f"could not read the GPUs from nvidia-smi: {error}", where="--devices") from error


def differences(profile: HardwareIdentity | None, here: HardwareIdentity, *, here_label: str = "this machine") -> list[str]:
    """One line per difference between the hardware a profile was measured on and `here`."""
    if profile is None:
        return [f"hardware: the profile does not record what it was measured on; {here_label} is {here.describe()}"]
    if profile.kind != here.kind:
        return [f"device kind: profile {profile.kind}, {here_label} {here.kind}"]
    lines = []
    label = "CPU" if here.kind == "cpu" else "GPU"
    if profile.name is None:
        lines.append(f"{label}: the profile does not record it, {here_label} {here.name}")
    elif here.name is not None and _name_key(here.kind, profile.name) != _name_key(here.kind, here.name):
        lines.append(f"{label}: profile {profile.name}, {here_label} {here.name}")
    if here.kind == "cpu" and here.cpu_flags is not None:
        if profile.cpu_flags is None:
            lines.append(f"CPU flags: the profile does not record them, {here_label} has {_listing(here.cpu_flags) or 'none of ' + _listing(KERNEL_FLAGS)}")
        else:
            lacking = tuple(f for f in here.cpu_flags if f not in profile.cpu_flags)
            extra = tuple(f for f in profile.cpu_flags if f not in here.cpu_flags)
            if lacking:
                lines.append(f"CPU flags: profile lacks {_listing(lacking)}, {here_label} has {_pronoun(lacking)}")
            if extra:
                lines.append(f"CPU flags: profile has {_listing(extra)}, {here_label} lacks {_pronoun(extra)}")
    if here.kind == "gpu" and None not in (profile.gpu_memory_mib, here.gpu_memory_mib) and profile.gpu_memory_mib != here.gpu_memory_mib:
        lines.append(f"GPU memory: profile {profile.gpu_memory_mib} MiB, {here_label} {here.gpu_memory_mib} MiB")
    if here.dtype is not None and profile.dtype != here.dtype:
        lines.append(f"dtype: profile {profile.dtype or 'not recorded'}, {here_label} {here.dtype}")
    return lines


def _name_key(kind: str, name: str) -> str:
    slug = name_slug(name)
    if kind == "cpu":
        return slug
    return "-".join(t for t in slug.split("-") if not re.fullmatch(r"nvidia|tesla|geforce|sxm\d*|pcie|nvl|hbm\d*e?|\d+gb?", t))


def _listing(items: tuple[str, ...]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}" if items else ""


def _pronoun(items: tuple[str, ...]) -> str:
    return "it" if len(items) == 1 else "them"


def same_gpu(a: str, b: str) -> bool:
    """Whether two GPU names are the same model (`NVIDIA A100-SXM4-80GB` and `A100-80G`)."""
    return _name_key("gpu", a) == _name_key("gpu", b)
