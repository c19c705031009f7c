"""Every exception class the Rust bindings raise by name exists in pagedkv.errors.

rust/py/errors.rs looks the classes up by name at run time (falling back to RuntimeError only
if the package is broken), so a misspelt or missing class would go unnoticed until that error
is raised. The names can only come from the `error_classes!` list there, which the extension
exports as `pagedkv._core.ERROR_CLASS_NAMES`; this test checks the list (as built, and as
written in the source, so a new name fails even before a rebuild) against errors.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pagedkv._core as core
from pagedkv import errors

ERRORS_RS = Path(__file__).resolve().parents[2] / "rust" / "py" / "errors.rs"


def source_names() -> list[str]:
    text = ERRORS_RS.read_text()
    m = re.search(r"^error_classes!\((.*?)\);", text, re.S | re.M)
    assert m, "error_classes!(...) invocation not found in rust/py/errors.rs"
    return [n.strip() for n in m.group(1).split(",") if n.strip()]


def test_source_list_matches_the_built_module() -> None:
    assert tuple(source_names()) == core.ERROR_CLASS_NAMES


@pytest.mark.parametrize("name", sorted(set(source_names()) | set(core.ERROR_CLASS_NAMES)))
def test_every_named_class_exists_and_is_a_pagedkv_error(name: str) -> None:
    cls = getattr(errors, name, None)
    assert isinstance(cls, type), f"rust/py/errors.rs names pagedkv.errors.{name}, which does not exist"
    assert issubclass(cls, errors.PagedKVError)
    assert name in errors.__all__


def test_classes_are_only_named_through_the_list() -> None:
    # Every `ErrorClass::X` used in the bindings is declared, and no class is named by a bare
    # string (py_error takes an ErrorClass).
    names = set(source_names())
    py_dir = ERRORS_RS.parent
    for path in py_dir.glob("*.rs"):
        text = path.read_text()
        for used in re.findall(r"ErrorClass::(\w+)", text):
            assert used in names, f"{path.name}: ErrorClass::{used} is not in error_classes!"
        assert not re.search(r"py_error\(\s*\"", text), f"{path.name}: py_error called with a string"


def test_a_core_error_raises_its_class() -> None:
    s = core.Scheduler(core.SchedulerConfig(num_blocks=4, block_size=4))
    with pytest.raises(errors.UnknownRequestError):
        s.abort_request("nope")
    with pytest.raises(errors.ConfigError):
        core.SchedulerConfig(num_blocks=0)
    with pytest.raises(errors.InvalidTypeError):
        s.abort_request(3)  # type: ignore[arg-type]
