"""Shared pytest setup.

Without a CUDA GPU the Triton kernels run in Triton's CPU interpreter. The interpreter is
chosen when a kernel is decorated, so ``TRITON_INTERPRET`` must be set before any module that
defines kernels is imported: that is done here, before test collection.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while waiting slow torch down 10-60x when another process holds a
# core (a busy CI or developer machine); passive waiting costs nothing otherwise. Must be set
# before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cores_per_xdist_worker() -> int | None:
    """Under pytest-xdist (``make test`` runs ``-n 3``): each worker's share of the usable cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


# N workers each with as many torch/OpenMP threads as there are cores oversubscribe the machine
# N times over; each takes its share instead. Set before torch is imported; servers and other
# subprocesses the tests start inherit it. An explicit OMP_NUM_THREADS wins.
_WORKER_CORES = _cores_per_xdist_worker()
if _WORKER_CORES is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_WORKER_CORES))

# torch.compile's caches (inductor's, and the compiled forwards pagedkv saves beside them:
# pagedkv.worker.compiled_artifact) start empty in every test process: with the machine's
# shared cache folder, a second run would load a forward that the first compiled, and its tests
# would take another path than on a clean machine. Servers and workers the tests start inherit
# the folder. An explicit TORCHINDUCTOR_CACHE_DIR wins.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="pagedkv-test-inductor-")
    atexit.register(shutil.rmtree, _INDUCTOR_CACHE, ignore_errors=True)

# Engines run eager unless a test asks for the compiled forward (enforce_eager=False): on the
# CPU the default compiles at start, tens of seconds per engine, and the suite starts hundreds
# (servers and workers inherit it). Tests of the default itself unset it (monkeypatch).
os.environ.setdefault("PAGEDKV_ENFORCE_EAGER", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 (tests/tiny_models.py) for tests about the engine, not the model; its
    tokenizer is the embedded model's (``tokenizer=default_model_dir()``)."""
    from tiny_models import save_tiny_qwen2

    return str(save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def gemma_model() -> str:
    """The embedded Gemma 3 270M's converted folder, in the normal cache (the first use on a
    machine converts it: ~2.5 min on one core; every later one only finds the folder)."""
    from pagedkv.worker.model_files import embedded_model_dir

    return str(embedded_model_dir("gemma-3-270m"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The modules that take longest (measured on 2 cores), slowest first. `make test` hands whole
# modules to its workers in collection order (--dist loadfile --no-loadscope-reorder): the
# long ones start first and the many short ones fill in behind them, so no worker is left
# alone with a long module at the end. Only a scheduling hint: any module may be missing here.
_SLOWEST_MODULES = (
    "test_readme.py",
    "test_router_disagg.py",
    "test_tensor_parallel.py",
    "test_server.py",
    "test_engine_kv_quant.py",
    "test_sampler.py",
    "test_attention_types.py",
    "test_beam_search.py",
    "test_clients_eval.py",
    "test_router.py",
    "test_kv_plane.py",
    "test_request_costs.py",
    "test_grammars.py",
    "test_kv_quant_triton.py",
    "test_clients_load.py",
    "test_engine_greedy.py",
    "test_model_files.py",
    "test_gemma3.py",
    "test_kv_connector.py",
    "test_kv_transport.py",
    "test_engine_hardening.py",
    "test_kernels_attention.py",
    "test_kernels_layer_attention.py",
    "test_dashboard_browser.py",
    "test_engine.py",
    "test_gpu_check_dryrun.py",
    "test_kernels_compile.py",
    "test_cli_offload.py",
    "test_dashboard.py",
)


def _slowest_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps the rest in order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slowest_first(items)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
