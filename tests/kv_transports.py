"""The KV transports the disaggregation tests run over: NIXL where its wheel is installed (the
``nixl`` extra; host memory on this machine), and gloo (torch.distributed) everywhere."""

from __future__ import annotations

import pytest

from pagedkv.distributed.kv_transport import nixl_available

TRANSPORTS = [
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")),
    "gloo",
]
