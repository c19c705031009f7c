"""lm-eval on this folder's quiz tasks, offline: one call to run a task against a model, and
readers for what came back. Shared by tests/serving/test_clients_eval.py and benches/bench_lm_eval.py.

The caller sets ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` (:data:`OFFLINE_ENV`) before
lm-eval, transformers or datasets are imported: the tasks' data and the tokenizer are local,
and nothing may be fetched.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent
MULTIPLE_CHOICE = "pagedkv_quiz_mc"  # 12 questions x 3 choices: 36 loglikelihood requests
GENERATION = "pagedkv_quiz_gen"  # 5 sentences to complete (generate_until)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def evaluate(model: str, model_args: dict[str, Any], task: str, **kwargs: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of one quiz task (only this folder's tasks are indexed, not
    lm-eval's thousands; no bootstrap for the standard errors), with every sample logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=manager,
        bootstrap_iters=0,
        log_samples=True,
        **kwargs,
    )
    if results is None:  # only on a non-zero rank of a distributed run, which this never is
        raise RuntimeError("lm_eval.simple_evaluate returned no results")
    return dict(results)


def completions_args(base_url: str, model: str, tokenizer: str, **extra: Any) -> dict[str, Any]:
    """``local-completions``' model arguments for ``pagedkv serve`` at ``base_url`` (``.../v1``):
    the tokenizer is the served model's local folder (lm-eval tokenizes the loglikelihood
    requests itself and sends token ids, its default); one try per request, so a refusal fails
    the run at once instead of after lm-eval's back-off."""
    return {
        "model": model,
        "base_url": base_url + "/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": tokenizer,
        "max_retries": 1,
        **extra,
    }


def samples(results: dict[str, Any], task: str) -> list[dict[str, Any]]:
    """The logged samples of ``task``, in document order."""
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def choice_loglikelihoods(results: dict[str, Any], task: str = MULTIPLE_CHOICE) -> list[list[float]]:
    """Per document, the loglikelihood lm-eval got for each choice (one request each)."""
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples(results, task)]


def accuracy(results: dict[str, Any], task: str = MULTIPLE_CHOICE) -> float:
    return float(results["results"][task]["acc,none"])


def all_finite(values: list[list[float]]) -> bool:
    return all(math.isfinite(v) for row in values for v in row)
