"""Each default and range is written once (issue: config from one source): EngineArgs, the
config dataclasses, the Rust scheduler and the CLI flags all derive them from the field
declarations in pagedkv.config and the Rust core's table (``_core.config_fields()``). Checked
here by introspection: no value below is copied from the sources."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from typing import Any

import pytest

import pagedkv
from pagedkv import _core
from pagedkv.cli import demo, generate, serve, simulate
from pagedkv.cli.engine_args import _plain, field_help
from pagedkv.config import (
    CORE_FIELDS,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulingConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedkv.config.fields import field_doc
from pagedkv.engine.args import EngineArgs
from pagedkv.errors import ConfigError

CONFIG_CLASSES = {
    cls.__name__: cls
    for cls in (CacheConfig, ModelConfig, ParallelConfig, SchedulingConfig, SpeculativeConfig, StructuredOutputsConfig)
}
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _core_fields() -> list[tuple[type, dataclasses.Field[Any]]]:
    """Every config dataclass field that is a setting of the Rust scheduler."""
    return [(cls, f) for cls in CONFIG_CLASSES.values() for f in dataclasses.fields(cls) if "core" in f.metadata]


def _base(cls: type, core: str) -> dict[str, Any]:
    """What a config needs besides the field under test (speculative decoding: a draft count,
    and the method whose parameter it is)."""
    if cls is not SpeculativeConfig or core == "num_speculative_tokens":
        return {}
    base: dict[str, Any] = {"num_speculative_tokens": 1}
    if core.startswith("suffix_"):
        base["method"] = "suffix"
    return base


def _outside(spec: dict[str, Any]) -> list[Any]:
    """Values just outside a setting's range, from its description."""
    kind, lo, hi = spec["kind"], spec["min"], spec["max"]
    if kind == "int":
        return [lo - 1] + ([] if hi is None else [hi + 1])
    if kind == "float":
        out = [lo if not spec["min_inclusive"] else lo - 1.0, float("nan")]
        if hi is not None:
            out.append(hi + 1.0 if spec["max_inclusive"] else hi)
        return out
    if kind == "choice":
        return ["no-such-" + spec["choices"][0], 1]
    return [1, "yes"]  # bool


def _inside(spec: dict[str, Any]) -> list[Any]:
    """Values at the edges of a setting's range."""
    kind, lo, hi = spec["kind"], spec["min"], spec["max"]
    if kind == "int":
        return [hi if hi is not None else lo]
    if kind == "float":
        return [lo if spec["min_inclusive"] else lo + 0.5] + ([hi] if hi is not None and spec["max_inclusive"] else [])
    if kind == "choice":
        return list(spec["choices"])
    return [True, False]


def test_every_core_setting_is_declared_by_a_config_class_or_is_internal() -> None:
    declared = {f.metadata["core"] for _, f in _core_fields()}
    # Set by the engine from what it measures or builds, not by users.
    internal = {"watermark", "num_disk_blocks", "max_model_len"} & set(CORE_FIELDS)
    assert declared | internal >= set(CORE_FIELDS) - {"num_disk_blocks", "watermark"}, set(CORE_FIELDS) - declared


@pytest.mark.parametrize(("cls", "f"), _core_fields(), ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_config_class_defaults_are_the_cores(cls: type, f: dataclasses.Field[Any]) -> None:
    spec = CORE_FIELDS[f.metadata["core"]]
    if f.metadata.get("core_default", True):
        assert f.default == spec["default"], (cls.__name__, f.name)
    else:  # None: "not given", the core's default applies (resolved on the built config)
        assert f.default is None


@pytest.mark.parametrize(("cls", "f"), _core_fields(), ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_config_class_ranges_are_the_cores(cls: type, f: dataclasses.Field[Any]) -> None:
    core = f.metadata["core"]
    spec = CORE_FIELDS[core]
    base = _base(cls, core)
    for bad in _outside(spec):
        with pytest.raises(ConfigError, match=rf"{f.name}\b"):
            cls(**base, **{f.name: bad})
        with pytest.raises(ConfigError, match=core):
            _core.check_config_fields(**{core: bad})
    for good in _inside(spec):
        if cls is CacheConfig and f.name == "block_size" and good < 8:
            continue  # the kernels need more than the core: a power of two from 8
        extra = {"model": "draft"} if good == "draft_model" else {}
        built = cls(**base, **extra, **{f.name: good})
        assert getattr(built, f.name) == good
        _core.check_config_fields(**{core: good})


def test_resolved_speculative_defaults_are_the_cores() -> None:
    ngram = SpeculativeConfig(num_speculative_tokens=1)
    suffix = SpeculativeConfig(num_speculative_tokens=1, method="suffix")
    for cfg in (ngram, suffix):
        for f in dataclasses.fields(cfg):
            core = f.metadata.get("core")
            value = getattr(cfg, f.name)
            if core and value is not None and core not in ("num_speculative_tokens", "speculative_method"):
                assert value == CORE_FIELDS[core]["default"], (cfg.method, f.name)
    assert ngram.suffix_decoding_max_tree_depth is None and suffix.prompt_lookup_min is None


def test_the_rust_scheduler_config_uses_the_same_defaults() -> None:
    cfg = _core.SchedulerConfig(num_blocks=64)
    # Speculative decoding is off without num_speculative_tokens (its getters say so).
    checked = [
        n
        for n in CORE_FIELDS
        if hasattr(cfg, n) and CORE_FIELDS[n]["default"] is not None and not n.startswith("speculative_")
    ]
    for name in checked:
        assert getattr(cfg, name) == CORE_FIELDS[name]["default"], name
    assert {"block_size", "max_num_seqs", "max_num_batched_tokens", "policy", "preemption_mode"} <= set(checked)


@pytest.mark.parametrize("name", [n for n, s in CORE_FIELDS.items() if s["kind"] == "int"])
def test_the_rust_scheduler_config_has_the_same_ranges(name: str) -> None:
    spec = CORE_FIELDS[name]
    kwargs: dict[str, Any] = {"num_blocks": spec["max"] or 64, "block_size": 1, "max_model_len": 1}
    if name.startswith(("prompt_", "suffix_")) or name == "num_speculative_tokens":
        kwargs["num_speculative_tokens"] = 1
        kwargs["speculative_method"] = "suffix" if name.startswith("suffix_") else "ngram"
    if name in ("num_host_blocks", "num_disk_blocks") and spec["max"] is not None:
        kwargs["num_host_blocks"] = 1  # a disk tier needs a host tier
    for bad in _outside(spec):
        # A negative count is refused as an argument before it is a config value.
        with pytest.raises((pagedkv.ConfigError, pagedkv.InvalidArgumentError), match=name):
            _core.SchedulerConfig(**{**kwargs, name: bad})


def test_engine_args_fields_are_config_fields() -> None:
    sourced = 0
    for name, f in ENGINE_FIELDS.items():
        assert field_doc(f), f"EngineArgs.{name} has no doc"
        if "source" not in f.metadata:
            continue
        cls_name, field_name = f.metadata["source"]
        source = {g.name: g for g in dataclasses.fields(CONFIG_CLASSES[cls_name])}[field_name]
        if f.metadata.get("inverse"):
            assert f.default is (not source.default), name
            continue
        sourced += 1
        assert f.default == source.default, name
        assert field_doc(f) == field_doc(source), name
        if "core" in source.metadata:
            for bad in _outside(CORE_FIELDS[source.metadata["core"]])[:1]:
                with pytest.raises(ConfigError, match=rf"{field_name}\b"):
                    EngineArgs(**{name: bad})
    assert sourced >= 25


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv serve")
    serve.add_arguments(p)
    return p


def _engine_actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags generated from EngineArgs fields (their help is the field's doc)."""
    helps = field_help()
    return {
        a.dest: a
        for a in p._actions
        if a.dest in ENGINE_FIELDS and a.help and helps[a.dest] and helps[a.dest] in a.help.replace("%%", "%")
    }


def test_serve_flags_have_the_engine_args_defaults_and_docs() -> None:
    actions = _engine_actions(_serve_parser())
    assert set(actions) == set(ENGINE_FIELDS) - {"model"}
    helps = field_help()
    for dest, action in actions.items():
        assert action.default == ENGINE_FIELDS[dest].default, dest
        assert action.help is not None and helps[dest] in action.help.replace("%%", "%"), dest


def test_serve_help_output_says_each_default() -> None:
    """The printed ``pagedkv serve --help``, parsed flag by flag."""
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv", "serve", "--help"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    section = out.split("engine (EngineArgs):", 1)[1]
    entries: dict[str, str] = {}  # flag -> its help entry, whitespace folded
    for entry in re.split(r"\n(?=  --)", section):
        if entry.strip():
            entries[entry.split()[0].rstrip(",")] = " ".join(entry.split())
    for name, f in ENGINE_FIELDS.items():
        if name == "model":
            continue
        entry = entries["--" + name.replace("_", "-")]
        if "default" in _plain(field_doc(f)).lower():
            continue  # the doc says it in words
        shown = "none" if f.default is None else str(f.default)
        assert re.search(rf"[Dd]efault: {re.escape(shown)}\b", entry), (name, entry[:200])


def test_other_commands_share_the_engine_flags() -> None:
    for module, own in ((generate, {}), (demo, {"kv_cache_memory", "max_model_len", "max_num_seqs"})):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        actions = _engine_actions(p)
        assert {"block_size", "preemption_mode", "num_host_blocks"} <= set(actions)
        for dest, action in actions.items():
            if dest not in own:
                assert action.default == ENGINE_FIELDS[dest].default, (module.__name__, dest)
    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    defaults = {a.dest: a.default for a in p._actions}
    for name in ("block_size", "max_num_seqs", "watermark"):
        assert defaults[name] == CORE_FIELDS[name]["default"], name


def test_the_hybrid_kv_cache_manager_flag_is_accepted() -> None:
    args = _serve_parser().parse_args(["m", "--disable-hybrid-kv-cache-manager"])
    assert args.disable_hybrid_kv_cache_manager is True
    assert EngineArgs(disable_hybrid_kv_cache_manager=True).create_engine_config().cache.enable_kv_cache_groups is False


def test_class_docstrings_carry_the_field_docs() -> None:
    for cls in (*CONFIG_CLASSES.values(), EngineArgs):
        for f in dataclasses.fields(cls):
            if field_doc(f):
                assert f"``{f.name}``: {field_doc(f)}" in (cls.__doc__ or ""), (cls.__name__, f.name)
