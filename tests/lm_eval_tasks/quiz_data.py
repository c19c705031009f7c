"""The quiz tasks' data: the JSONL files beside this module, loaded for lm-eval's
``custom_dataset`` hook. Nothing is downloaded, and the files are found whatever the working
directory (a YAML ``data_files`` path would be relative to it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def _load(file_name: str) -> dict[str, datasets.Dataset]:
    lines = (HERE / file_name).read_text().splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}


# lm-eval calls these with the task's metadata and dataset_kwargs as keywords; none are needed.
def load_multiple_choice(**_: Any) -> dict[str, datasets.Dataset]:
    return _load("quiz_mc.jsonl")


def load_generation(**_: Any) -> dict[str, datasets.Dataset]:
    return _load("quiz_gen.jsonl")
