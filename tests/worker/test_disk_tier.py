"""The disk tier (``kv_cache_dir``) on a real engine (the tiny random model of
tests/tiny_models.py: the tier's files, not the weights, are under test): a restarted engine
warms its prefix cache from the files and generates exactly what it generated the first time;
files that are corrupt, truncated or written for another model are skipped with a warning,
never served; a failed write degrades to recompute; bad sizes are typed errors."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.worker.disk_cache import DiskKVStore

TEXTS = [
    "The history of the Roman Empire begins with the founding of the city, and " * 4,
    "In a small village by the sea there lived an old fisherman who every morning " * 4,
    "Python is a programming language that lets you work quickly and integrate " * 4,
]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def engine_kwargs(model: str, folder: Path | None, **over: object) -> dict:
    """24 device blocks and 8 host blocks: the prompts' blocks spill to disk during the run.
    ``folder=None``: neither a host nor a disk tier."""
    kw: dict = dict(model=model, dtype="float32", device="cpu", block_size=16, num_blocks=24, max_model_len=256)
    if folder is not None:
        kw |= {"num_host_blocks": 8, "kv_cache_dir": str(folder)}
    return kw | over


def generate(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(TEXTS, GREEDY, use_tqdm=False)]


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("pagedkv-*/slot-*.kvb"))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> tuple[Path, list[list[int]]]:
    """One engine's run, shut down (flushed to disk); the folder is copied by each test."""
    folder = tmp_path_factory.mktemp("kv")
    with LLM(**engine_kwargs(tiny_model, folder)) as llm:
        tokens = generate(llm)
        stats = llm.llm_engine.get_stats()
    assert stats["num_disk_blocks"] > 0
    assert block_files(folder), "the flush at shutdown wrote no block file"
    return folder, tokens


def copy_folder(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_restarted_engine_hits_the_disk_tier(
    first_run: tuple[Path, list[list[int]]], tiny_model: str, tmp_path: Path
) -> None:
    folder = copy_folder(first_run[0], tmp_path / "kv")
    llm = LLM(**engine_kwargs(tiny_model, folder))
    stats = llm.llm_engine.get_stats()
    assert stats["num_restored_disk_blocks"] == len(block_files(folder)) > 0
    assert generate(llm) == first_run[1]
    stats = llm.llm_engine.get_stats()
    assert stats["prefix_cache_disk_hits"] > 0 and stats["blocks_read_from_disk"] > 0
    assert stats["prefix_cache_disk_hits"] <= stats["prefix_cache_hits"]
    llm.llm_engine.scheduler.check_invariants()


@pytest.mark.parametrize("damage", ["payload", "truncate", "fingerprint", "magic", "tokens"])
def test_damaged_files_are_skipped_never_served(
    first_run: tuple[Path, list[list[int]]], tiny_model: str, tmp_path: Path, damage: str
) -> None:
    folder = copy_folder(first_run[0], tmp_path / "kv")
    files = block_files(folder)
    for path in files:  # damage every file: none may be served
        data = bytearray(path.read_bytes())
        if damage == "payload":
            data[-10] ^= 0xFF
        elif damage == "truncate":
            data = data[: len(data) - 100]
        elif damage == "magic":
            data[0:8] = b"NOTPAGED"
        else:
            n = int.from_bytes(data[8:12], "little")
            header = json.loads(data[12 : 12 + n])
            if damage == "fingerprint":
                header["fingerprint"]["num_layers"] += 1
            else:  # tokens that do not match the block's hash
                header["tokens"][0] = (header["tokens"][0] + 1) % 1000
            raw = json.dumps(header).encode().ljust(n)[:n]
            data[12 : 12 + n] = raw
        path.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(**engine_kwargs(tiny_model, folder))
    assert llm.llm_engine.get_stats()["num_restored_disk_blocks"] == 0
    assert any("KV disk tier" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert generate(llm) == first_run[1]
    assert llm.llm_engine.get_stats()["prefix_cache_disk_hits"] == 0


def test_failed_writes_degrade_to_recompute(tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: DiskKVStore, slot: int, host_block: int, info: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskKVStore, "_write", full_disk)
    reference = generate(LLM(**engine_kwargs(tiny_model, None)))
    llm = LLM(**engine_kwargs(tiny_model, tmp_path / "kv"))
    with pytest.warns(UserWarning, match="cannot write slot"):
        # Twice: the second round looks the prompts up after the first wrote (failed) to disk.
        assert generate(llm) == reference
        assert generate(llm) == reference
        llm.shutdown()
    stats = llm.llm_engine.get_stats()
    assert stats["prefix_cache_disk_hits"] == 0
    assert stats["num_disk_cached_blocks"] == 0, "a slot whose write failed is still cached"
    llm.llm_engine.scheduler.check_invariants()


def test_bad_disk_settings_are_config_errors(tiny_model: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="host tier"):
        LLM(**engine_kwargs(tiny_model, None, kv_cache_dir=str(tmp_path / "a")))
    with pytest.raises(ConfigError, match="less than one block file"):
        LLM(**engine_kwargs(tiny_model, tmp_path / "b", kv_cache_dir_max_bytes=1000))
    with pytest.raises(ConfigError, match="kv_cache_dir_max_bytes"):
        LLM(**engine_kwargs(tiny_model, tmp_path / "c", kv_cache_dir_max_bytes=-5))
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        LLM(**engine_kwargs(tiny_model, tmp_path / "d", enable_prefix_caching=False))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="kv_cache_dir"):
        LLM(**engine_kwargs(tiny_model, blocker))
    assert not os.path.exists(tmp_path / "a")


# KV cache groups: a model whose layers alternate a 12-token sliding window and full attention
# (gemma3_text, random weights) keeps two columns, pages of two layers; its files carry their
# column, and a restarted engine serves hits in both.
WINDOWED_PROMPTS = [[(11 * i + 5 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((70, 90, 60))]


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import save_tiny_windowed

    return save_tiny_windowed(tmp_path_factory.mktemp("windowed"))


def test_kv_cache_groups_restart_from_the_disk_tier(windowed_model: str, tmp_path: Path) -> None:
    from pagedkv.worker.model_files import default_model_dir

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in WINDOWED_PROMPTS], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    kw = dict(
        engine_kwargs(windowed_model, tmp_path / "kv", block_size=8, num_blocks=40, max_model_len=128),
        tokenizer=str(default_model_dir()),
    )
    reference = run(
        LLM(
            **dict(
                engine_kwargs(windowed_model, None, block_size=8, num_blocks=40, max_model_len=128),
                tokenizer=kw["tokenizer"],
            )
        )
    )
    with LLM(**kw) as llm:
        assert llm.llm_engine.runner.kv_layout.num_kv_groups == 2, llm.llm_engine.runner.kv_layout_note
        assert run(llm) == reference
    columns = {json.loads(_header_bytes(path))["column"] for path in block_files(tmp_path / "kv")}
    assert columns == {0, 1}, columns
    llm = LLM(**kw)
    stats = llm.llm_engine.get_stats()
    assert stats["num_restored_disk_blocks"] > 0
    assert run(llm) == reference
    stats = llm.llm_engine.get_stats()
    assert stats["prefix_cache_disk_hits"] > 0 and stats["blocks_read_from_disk"] > 0, stats
    llm.llm_engine.scheduler.check_invariants()


def _header_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    n = int.from_bytes(data[8:12], "little")
    return data[12 : 12 + n]
