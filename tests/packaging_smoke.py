"""Smoke check of an installed pagedkv (run by `make test-packaging` inside fresh virtual
environments that hold only the wheel and numpy): the extension imports, the typing files are
shipped, the core works end to end, and without torch the engine's entry points (``pagedkv.LLM``,
``pagedkv generate``) say ``pip install 'pagedkv[engine]'``."""

from __future__ import annotations

import importlib.resources
import importlib.util

import numpy as np

import pagedkv

files = importlib.resources.files("pagedkv")
assert files.joinpath("py.typed").is_file(), "py.typed is missing from the package"
assert files.joinpath("_core.pyi").is_file(), "_core.pyi is missing from the package"
assert files.joinpath("kernels", "reference.py").is_file(), "the kernels package is missing"

a = pagedkv.BlockAllocator(8, 4)
blocks = a.allocate(2)
assert blocks == [0, 1]
a.free(blocks)
try:
    a.free([0])
except pagedkv.InvalidBlockError:
    pass
else:
    raise AssertionError("double free must raise")

s = pagedkv.Scheduler(pagedkv.SchedulerConfig(num_blocks=16, block_size=4))
s.add_request("r", [1, 2, 3], max_tokens=2)
while s.has_unfinished_requests():
    out = s.schedule()
    s.update(out, np.zeros(len(out.logits_indices), dtype=np.int64))
s.check_invariants()
# Package data ships too: the live KV-cache page of `pagedkv serve`.
from importlib import resources

assert resources.files("pagedkv.server").joinpath("static/dashboard.html").is_file(), "dashboard.html not packaged"

# Without the engine extra (no torch here), the engine's entry points say what to install
# instead of a bare ModuleNotFoundError: the Python API and the command line.
if importlib.util.find_spec("torch") is None:
    import subprocess
    import sys

    try:
        pagedkv.LLM()
    except pagedkv.MissingDependencyError as exc:
        assert isinstance(exc, ImportError) and "pip install 'pagedkv[engine]'" in str(exc), exc
    else:
        raise AssertionError("pagedkv.LLM() without torch must raise MissingDependencyError")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "generate", "--prompt", "hi"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "pip install 'pagedkv[engine]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
print(f"pagedkv {pagedkv.__version__} from {pagedkv.__file__}: OK")
