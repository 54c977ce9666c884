"""How the vLLM engine is started, without vLLM: eager or compiled, and the worker's CPU settings
(mta.generation.vllm_engine; the engine itself is tested in tests/test_vllm_engine.py)."""

from __future__ import annotations

import os

import torch

from mta.generation.vllm_engine import COMPILE_ON_CPU, EngineSettings, core_list, worker_environment

CPU, GPU = torch.device("cpu"), torch.device("cuda", 1)


def test_a_cpu_engine_runs_eagerly_unless_compiling_is_asked_for_and_a_gpu_engine_compiles(monkeypatch):
    monkeypatch.delenv(COMPILE_ON_CPU, raising=False)
    assert EngineSettings().eager_on(CPU) and not EngineSettings().eager_on(GPU)
    monkeypatch.setenv(COMPILE_ON_CPU, "1")
    assert not EngineSettings().eager_on(CPU) and not EngineSettings().eager_on(GPU)
    monkeypatch.setenv(COMPILE_ON_CPU, "0")
    assert EngineSettings().eager_on(CPU)
    # The setting given wins over the environment, either way and on either device.
    assert EngineSettings(enforce_eager=True).eager_on(GPU) and not EngineSettings(enforce_eager=False).eager_on(CPU)


def test_the_cpu_worker_gets_a_kv_cache_and_every_core_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = worker_environment(CPU)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == core_list()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2})
    assert core_list() == "1-3"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 0, 2})
    assert core_list() == "0,2,5"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert worker_environment(CPU)["VLLM_CPU_KVCACHE_SPACE"] == "8"


def test_a_gpu_worker_sees_only_this_ranks_device(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert worker_environment(GPU)["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert worker_environment(GPU)["CUDA_VISIBLE_DEVICES"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in worker_environment(GPU)
