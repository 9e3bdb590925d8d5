"""Hardware identity: parsed from /proc/cpuinfo and nvidia-smi, recorded in profiles, and
every difference between a profile and the machine (or the planned hardware) and the run's
engine settings said in the plan's notes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

import batchllm.planner.cluster as cluster_module
from batchllm.core.errors import UserError
from batchllm.costmodel.profile import Profile
from batchllm.dag.model import EngineSpec
from batchllm.engines.devices import DeviceSet
from batchllm.engines.hardware import (
    HardwareIdentity,
    cpu_engine_dtype,
    differences,
    parse_cpuinfo,
    parse_nvidia_smi,
    seen_with_flags,
)
from batchllm.planner.cluster import parse_cluster, run_settings
from batchllm.planner.plan_file import plan_dag_file
from batchllm.runtime.launch import run_dag_file
from tests.conftest import ENSEMBLE_DAG
from tests.fakes import FakeEngineFactory

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "profiles"
COMMON = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
          "lm constant_tsc rep_good nopl pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c "
          "rdrand hypervisor lahf_lm abm fsgsbase bmi1 avx2 smep bmi2 erms")


def cpuinfo(model_name: str, extra_flags: str, processors: int = 2) -> str:
    block = (f"processor\t: {{i}}\nvendor_id\t: x\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: {model_name}\n"
             f"flags\t\t: {COMMON} {extra_flags}\nbugs\t\t: spectre_v1\n\n")
    return "".join(block.replace("{i}", str(i)) for i in range(processors))


# An AVX2-only EPYC (Rome), an EPYC with AVX-512 and BF16 as these hosts report it (Genoa,
# model name cut to "AMD EPYC"), and an Intel Xeon with AMX (Sapphire Rapids).
EPYC_AVX2 = cpuinfo("AMD EPYC 7B12", "sha_ni clzero xsaveerptr")
EPYC_AVX512 = cpuinfo("AMD EPYC", "avx512f avx512dq avx512ifma avx512cd sha_ni avx512bw avx512vl avx512_bf16 clzero "
                                  "avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm")
XEON_AMX = cpuinfo("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
                   "avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx512_fp16 amx_bf16 amx_tile amx_int8")
NVIDIA_SMI = "".join("NVIDIA A100-SXM4-80GB, 81920\n" for _ in range(8))

ROME = HardwareIdentity("cpu", "AMD EPYC 7B12", "float32", ("avx2",))
GENOA = HardwareIdentity("cpu", "AMD EPYC", "bfloat16", ("avx2", "avx512f", "avx512_bf16"))
SAPPHIRE = HardwareIdentity("cpu", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "bfloat16",
                            ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))


def test_cpuinfo_gives_the_model_name_and_the_flags_that_pick_vllm_kernels():
    assert parse_cpuinfo(EPYC_AVX2) == ROME
    assert parse_cpuinfo(EPYC_AVX512) == GENOA
    assert parse_cpuinfo(XEON_AMX) == SAPPHIRE
    assert parse_cpuinfo("processor\t: 0\n") == HardwareIdentity("cpu", None, "bfloat16", None)  # no flags line: unknown
    assert (cpu_engine_dtype(ROME.cpu_flags), cpu_engine_dtype(GENOA.cpu_flags), cpu_engine_dtype(None)) == ("float32", None, None)
    # AVX-512 without BF16 in hardware (a VM that hides avx512_bf16 and AMX): float32, as measured faster there
    xeon_hidden_bf16 = parse_cpuinfo(cpuinfo("Intel(R) Xeon(R) Processor", "avx2 avx512f avx512bw"))
    assert (xeon_hidden_bf16.dtype, xeon_hidden_bf16.cpu_flags) == ("float32", ("avx2", "avx512f"))
    assert cpu_engine_dtype(("avx2", "avx512f", "amx_tile", "amx_bf16")) is None
    assert (ROME.folder_name, GENOA.folder_name, SAPPHIRE.folder_name) == ("cpu-amd-epyc-7b12", "cpu-amd-epyc",
                                                                          "cpu-intel-xeon-platinum-8481c")


def test_a_host_seen_with_other_flags_runs_engines_as_that_kind_would():
    """BATCHLLM_CPU_FLAGS=avx2 on an AVX-512 host: float32 engines and the AVX2 identity, as on an AVX2-only host."""
    assert seen_with_flags(GENOA, "avx2") == HardwareIdentity("cpu", "AMD EPYC", "float32", ("avx2",))
    assert seen_with_flags(ROME, " avx512f, avx2 ,avx512_bf16") == HardwareIdentity("cpu", "AMD EPYC 7B12", "bfloat16",
                                                                                    ("avx2", "avx512f", "avx512_bf16"))
    with pytest.raises(UserError, match=r"'avx2,avx-512' names avx-512, not a CPU kernel flag"):
        seen_with_flags(GENOA, "avx2,avx-512")


def test_nvidia_smi_gives_the_gpu_name_memory_and_count():
    a100 = parse_nvidia_smi(NVIDIA_SMI)
    assert a100 == HardwareIdentity("gpu", "NVIDIA A100-SXM4-80GB", "bfloat16", gpu_memory_mib=81920, gpu_count=8)
    assert a100.folder_name == "gpu-nvidia-a100-sxm4-80gb"
    assert a100.describe() == "8x NVIDIA A100-SXM4-80GB (81920 MiB, engines bfloat16)"
    with pytest.raises(ValueError, match="unexpected nvidia-smi output"):
        parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    with pytest.raises(ValueError):
        parse_nvidia_smi("")


def test_identities_round_trip_through_json():
    for identity in (ROME, SAPPHIRE, parse_nvidia_smi(NVIDIA_SMI), HardwareIdentity("cpu", "Intel Xeon", "bfloat16")):
        assert HardwareIdentity.from_dict(json.loads(json.dumps(identity.to_dict()))) == identity
    assert GENOA.to_dict() == {"kind": "cpu", "name": "AMD EPYC", "dtype": "bfloat16", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}


def test_differences_name_each_way_the_hardware_differs():
    assert differences(GENOA, GENOA) == []
    assert differences(ROME, GENOA) == [
        "CPU: profile AMD EPYC 7B12, this machine AMD EPYC",
        "CPU flags: profile lacks avx512f and avx512_bf16, this machine has them",
        "dtype: profile float32, this machine bfloat16",
    ]
    assert differences(SAPPHIRE, GENOA) == [
        "CPU: profile Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, this machine AMD EPYC",
        "CPU flags: profile has amx_tile and amx_bf16, this machine lacks them",
    ]
    inferred_xeon = HardwareIdentity("cpu", "Intel Xeon", "bfloat16")  # flags not recorded
    assert differences(inferred_xeon, HardwareIdentity("cpu", "Intel(R) Xeon(R) CPU @ 2.20GHz", "bfloat16", ("avx2", "avx512f"))) == [
        "CPU flags: the profile does not record them, this machine has avx2 and avx512f",  # same CPU name by its slug
    ]
    assert differences(None, GENOA) == [
        "hardware: the profile does not record what it was measured on; this machine is AMD EPYC (avx2, avx512f, avx512_bf16; engines bfloat16)",
    ]
    a100_80 = parse_nvidia_smi(NVIDIA_SMI)
    a100_40 = parse_nvidia_smi("NVIDIA A100-SXM4-40GB, 40960\n")
    assert differences(a100_40, a100_80) == ["GPU memory: profile 40960 MiB, this machine 81920 MiB"]
    catalog_a100 = HardwareIdentity("gpu", "A100-80G", "bfloat16", gpu_memory_mib=81920, gpu_count=2)
    assert differences(a100_80, catalog_a100, here_label="planned hardware") == []  # same GPU; the count is not compared
    h100 = parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559\n")
    assert differences(a100_80, h100) == ["GPU: profile NVIDIA A100-SXM4-80GB, this machine NVIDIA H100 80GB HBM3",
                                          "GPU memory: profile 81920 MiB, this machine 81559 MiB"]
    assert differences(ROME, a100_80) == ["device kind: profile cpu, this machine gpu"]


def test_committed_cpu_profiles_carry_what_is_known_of_their_hardware():
    epyc = Profile.load(PROFILES / "cpu-amd-epyc" / "smollm2-135m")
    assert epyc.identity == HardwareIdentity("cpu", "AMD EPYC", "float32", ("avx2",))
    xeon = Profile.load(PROFILES / "cpu-intel-xeon" / "smollm2-135m")
    assert xeon.identity == HardwareIdentity("cpu", "Intel Xeon", "bfloat16", None)
    for profile in (epyc, xeon):
        assert profile.identity.dtype == profile.engine["dtype"]
        assert str(profile.notes["identity_inferred"]).startswith("inferred on 2026-11-23, not read from the machine")


def copied_profile(root: Path, folder: str, model: str = "smollm2-135m", source: str = "cpu-amd-epyc", **changes) -> Path:
    """A committed profile copied under `root/folder/model` (and named `model`), its
    profile.json changed: a key set to None is removed, `engine` entries are merged."""
    target = root / folder / model
    shutil.copytree(PROFILES / source / "smollm2-135m", target)
    body = json.loads((target / "profile.json").read_text())
    body["model"] = model
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        elif key == "engine":
            body["engine"].update(value)
        else:
            body[key] = value
    (target / "profile.json").write_text(json.dumps(body, indent=2))
    return target


def test_a_profile_round_trips_its_identity_and_one_without_it_loads(tmp_path):
    saved = copied_profile(tmp_path, "a", identity=SAPPHIRE.to_dict())
    profile = Profile.load(saved)
    assert profile.identity == SAPPHIRE
    profile.save(tmp_path / "b")
    assert Profile.load(tmp_path / "b").identity == SAPPHIRE
    assert Profile.load(copied_profile(tmp_path, "c", identity=None)).identity is None
    no_dtype = Profile.load(copied_profile(tmp_path, "d", identity={"kind": "cpu", "name": "AMD EPYC", "cpu_flags": ["avx2"]}))
    assert no_dtype.identity == HardwareIdentity("cpu", "AMD EPYC", "float32", ("avx2",))  # the dtype it ran, from its settings


@pytest.fixture
def machine(monkeypatch):
    """This machine, as the planner sees it: an AVX-512 + BF16 EPYC with vLLM 0.32.0."""
    def use(identity: HardwareIdentity, engine_version: str | None = "vllm 0.32.0") -> None:
        monkeypatch.setattr(cluster_module, "this_machine", lambda kind: identity)
        monkeypatch.setattr(cluster_module, "installed_engine_version", lambda: engine_version)
    use(GENOA)
    return use


def test_the_committed_avx2_profile_on_an_avx512_epyc_is_noted_not_used_silently(machine):
    report = plan_dag_file(REPO / "dags" / "router.yaml", "cpu:2")
    assert report.problem.notes[:2] == (
        "profile cpu-amd-epyc/smollm2-135m does not match: CPU flags: profile lacks avx512f and avx512_bf16, this machine has them",
        "profile cpu-amd-epyc/smollm2-135m does not match: dtype: profile float32, this machine bfloat16",
    )
    assert report.chosen.total_s > 0  # still used


def test_a_plan_with_a_profile_of_another_cpu_names_the_mismatch(tmp_path, machine):
    root = tmp_path / "profiles"
    copied_profile(root, "cpu-amd-epyc", identity=SAPPHIRE.to_dict(), engine={"dtype": "bfloat16"})
    report = plan_dag_file(REPO / "dags" / "router.yaml", "cpu:2", profiles_root=root)
    assert report.problem.notes == (
        "profile cpu-amd-epyc/smollm2-135m does not match: CPU: profile Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz, this machine AMD EPYC",
        "profile cpu-amd-epyc/smollm2-135m does not match: CPU flags: profile has amx_tile and amx_bf16, this machine lacks them",
        "tech_expert: `where` assumed to keep 50% of rows (shared with its sibling routes)",
        "generalist: `where` assumed to keep 50% of rows (shared with its sibling routes)",
    )
    assert report.chosen.total_s > 0


def test_a_cpu_without_a_profile_takes_the_closest_cpu_kinds_and_says_how_it_differs(machine):
    machine(SAPPHIRE)  # no profiles/cpu-intel-xeon-platinum-8481c: the Xeon profile is closer than the AVX2 EPYC's
    report = plan_dag_file(REPO / "dags" / "chain_summary.yaml", "cpu:2")
    assert report.cluster.hardware == "cpu-intel-xeon-platinum-8481c"
    assert report.problem.notes == (
        "profile cpu-intel-xeon/smollm2-135m does not match: CPU: profile Intel Xeon, this machine Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
        "profile cpu-intel-xeon/smollm2-135m does not match: CPU flags: the profile does not record them, this machine has avx2, avx512f, avx512_bf16, amx_tile and amx_bf16",
    )


def test_a_profile_taken_with_other_engine_settings_is_noted_and_still_used(tmp_path, workspace, machine):
    root = tmp_path / "profiles"
    copied_profile(root, "cpu-amd-epyc", identity=GENOA.to_dict(), engine={"dtype": "bfloat16", "engine_version": "vllm 0.31.0"})
    dag = workspace.dag("""
        inputs:
          questions: {path: questions.parquet, id_column: id}
        engine: {max_num_seqs: 64, enforce_eager: false}
        nodes:
          answer:
            model: smollm2-135m
            prompt: "{{ question }}"
        outputs:
          answers: {columns: {answer: answer}}
    """)
    report = plan_dag_file(dag, "cpu:2", profiles_root=root)
    assert report.problem.notes == (
        "profile cpu-amd-epyc/smollm2-135m does not match: max_num_seqs: profile 128, run 64",
        "profile cpu-amd-epyc/smollm2-135m does not match: enforce_eager: profile True, run False",
        "profile cpu-amd-epyc/smollm2-135m does not match: engine_version: profile vllm 0.31.0, run vllm 0.32.0",
    )
    assert report.chosen.total_s > 0


def test_a_profile_without_an_identity_is_noted_with_its_dtype(tmp_path, machine):
    root = tmp_path / "profiles"
    copied_profile(root, "cpu-amd-epyc", identity=None)
    notes = plan_dag_file(REPO / "dags" / "chain_summary.yaml", "cpu:2", profiles_root=root).problem.notes
    assert notes == (
        "profile cpu-amd-epyc/smollm2-135m does not match: hardware: the profile does not record what it was measured on; "
        "this machine is AMD EPYC (avx2, avx512f, avx512_bf16; engines bfloat16)",
        "profile cpu-amd-epyc/smollm2-135m does not match: dtype: profile float32, run bfloat16",
    )


def test_planning_for_other_hardware_compares_with_that_hardware_not_this_machine(tmp_path, machine):
    assert parse_cluster("8xA100-80G", PROFILES).identity == HardwareIdentity("gpu", "A100-80G", "bfloat16", gpu_memory_mib=81920, gpu_count=8)
    assert plan_dag_file(REPO / "dags" / "chain_summary.yaml", "2xA100-80G").problem.notes == ()  # analytic: computed for it
    root = tmp_path / "profiles"
    shutil.copytree(PROFILES / "analytic" / "A100-80G" / "smollm2-135m", root / "analytic" / "A100-80G" / "smollm2-135m")
    (root / "analytic" / "catalog.yaml").write_text((PROFILES / "analytic" / "catalog.yaml").read_text())
    measured_40g = parse_nvidia_smi("NVIDIA A100-SXM4-40GB, 40960\n" * 4)  # filed under A100-80G by mistake
    copied_profile(root, "A100-80G", source="analytic/A100-80G", kind="measured", identity=measured_40g.to_dict())
    notes = plan_dag_file(REPO / "dags" / "chain_summary.yaml", "2xA100-80G", profiles_root=root).problem.notes
    assert notes == ("profile A100-80G/smollm2-135m does not match: GPU memory: profile 40960 MiB, planned hardware 81920 MiB",)


def test_run_settings_are_what_is_known_before_an_engine_starts(machine):
    cpu = parse_cluster("cpu:2", PROFILES)
    assert cpu.local and cpu.identity == GENOA
    assert run_settings(EngineSpec(), cpu) == {"enforce_eager": True, "dtype": "bfloat16", "engine_version": "vllm 0.32.0"}
    gpu = parse_cluster("2xH100-80G", PROFILES)
    assert run_settings(EngineSpec(max_num_seqs=32), gpu) == {"enforce_eager": False, "max_num_seqs": 32, "dtype": "bfloat16"}


def test_batchllm_run_prints_the_plan_notes(tmp_path, workspace, machine):
    root = tmp_path / "profiles"
    copied_profile(root, "cpu-amd-epyc", model="tiny-model")
    console = Console(record=True, width=300)
    run_dag_file(workspace.dag(ENSEMBLE_DAG), workspace.out, DeviceSet("cpu", (0, 1)), console=console,
                 engine_factory=FakeEngineFactory(), prefix_order=False, schedule="plan", profiles_root=root)
    lines = console.export_text().splitlines()
    assert lines[:2] == [
        "plan note: profile cpu-amd-epyc/tiny-model does not match: CPU flags: profile lacks avx512f and avx512_bf16, this machine has them",
        "plan note: profile cpu-amd-epyc/tiny-model does not match: dtype: profile float32, this machine bfloat16",
    ]
