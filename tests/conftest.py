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

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
