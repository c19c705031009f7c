"""Loglikelihood agreement: lm-eval scoring the repo's multiple-choice task through `pagedkv serve`
and through transformers in-process, request by request.

The task is tests/lm_eval_tasks/pagedkv_quiz_mc.yaml (12 questions x 3 choices: one
loglikelihood request per choice, over a local JSONL file). The same lm-eval run twice:

* ``local-completions`` against ``python -m pagedkv serve`` (started with
  :class:`pagedkv.server.launch.ServerProcess`, stopped before the second run: the CPU is
  shared): lm-eval tokenizes with the model folder's tokenizer and sends token-id prompts with
  ``echo: true, logprobs: 1, max_tokens: 1``, then sums the prompt positions' ``token_logprobs``;
* lm-eval's ``hf`` model: transformers' ``AutoModelForCausalLM`` on the same folder, float32.

Both see the same tokens (lm-eval's tokenization), so every request's loglikelihood can be
compared. The target: equal accuracy, and every loglikelihood within 1e-3 (float32).
Also compared: lm-eval's ``is_greedy`` flag per request (the continuation is the argmax at every
position), which the server's ``top_logprobs`` decide.

    python benches/bench_lm_eval.py [--model DIR] [--device cpu|cuda] [--batch-size 4] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from lm_eval_tasks.harness import (  # noqa: E402
    MULTIPLE_CHOICE,
    OFFLINE_ENV,
    accuracy,
    all_finite,
    choice_loglikelihoods,
    completions_args,
    evaluate,
    samples,
)

# Nothing is downloaded: set before lm-eval, transformers or datasets are imported.
os.environ.update(OFFLINE_ENV)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _results import add_write_flag, machine, md_table, write_section  # noqa: E402

SECTION = "lm_eval_loglikelihood"
HEADING = "## Loglikelihood agreement: lm-eval through `pagedkv serve` vs transformers (issue 26)"
SERVED_NAME = "smol"
TOLERANCE = 1e-3


def greedy_flags(results: dict[str, Any]) -> list[bool]:
    """lm-eval's ``is_greedy`` of every request, in document then choice order."""
    return [bool(resp[0][1]) for sample in samples(results, MULTIPLE_CHOICE) for resp in sample["resps"]]


def run_server(model_dir: str, device: str, batch_size: int) -> tuple[dict[str, Any], float]:
    from pagedkv.server.launch import ServerProcess

    flags = [
        str(model_dir), "--served-model-name", SERVED_NAME, "--dtype", "float32", "--device", device,
        "--max-model-len", "512", "--max-num-seqs", str(max(batch_size, 1)), "--log-level", "warning",
    ]  # fmt: skip
    with ServerProcess(flags) as server:
        args = completions_args(server.url + "/v1", SERVED_NAME, model_dir, batch_size=batch_size)
        t = time.perf_counter()
        results = evaluate("local-completions", args, MULTIPLE_CHOICE)
        return results, time.perf_counter() - t


def run_hf(model_dir: str, device: str, batch_size: int) -> tuple[dict[str, Any], float]:
    t = time.perf_counter()
    args = {"pretrained": model_dir, "dtype": "float32", "device": device}
    results = evaluate("hf", args, MULTIPLE_CHOICE, batch_size=batch_size)
    return results, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2, converted)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda, for both the server and transformers")
    ap.add_argument("--batch-size", type=int, default=4, help="lm-eval batch size (prompts per request)")
    add_write_flag(ap)
    args = ap.parse_args()
    if args.model is None:
        from pagedkv.worker.model_files import default_model_dir

        args.model = str(default_model_dir())

    served, served_s = run_server(args.model, args.device, args.batch_size)
    reference, reference_s = run_hf(args.model, args.device, args.batch_size)

    ours, theirs = choice_loglikelihoods(served), choice_loglikelihoods(reference)
    assert all_finite(ours) and all_finite(theirs), "a loglikelihood is not finite"
    diffs = [abs(a - b) for row_a, row_b in zip(ours, theirs, strict=True) for a, b in zip(row_a, row_b, strict=True)]
    greedy_same = sum(a == b for a, b in zip(greedy_flags(served), greedy_flags(reference), strict=True))
    picks_same = sum(
        max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
        for a, b in zip(ours, theirs, strict=True)
    )
    acc_ours, acc_theirs = accuracy(served), accuracy(reference)
    max_diff, mean_diff = max(diffs), sum(diffs) / len(diffs)
    verdict = "met" if acc_ours == acc_theirs and max_diff <= TOLERANCE else "NOT met"

    table = md_table(
        ["lm-eval model", "accuracy", "requests", "seconds"],
        [
            ["`local-completions` -> `pagedkv serve`", acc_ours, len(diffs), served_s],
            ["`hf` (transformers in-process)", acc_theirs, len(diffs), reference_s],
        ],
    )
    summary = (
        f"Per-request loglikelihood |difference|: max {max_diff:.2e}, mean {mean_diff:.2e} over {len(diffs)} "
        f"requests ({len(ours)} documents); same choice picked on {picks_same}/{len(ours)} documents; "
        f"lm-eval's is_greedy the same on {greedy_same}/{len(diffs)} requests. Target (equal accuracy, "
        f"max difference <= {TOLERANCE:g}, float32 on {args.device}): {verdict}."
    )
    print(table)
    print(summary)
    if args.no_write:
        return
    body = (
        f"Task: tests/lm_eval_tasks/pagedkv_quiz_mc.yaml; model folder `{Path(args.model).name}`, float32; "
        f"lm-eval batch size {args.batch_size}.\n\n{table}\n\n{summary}\n\nSeconds: each lm-eval run's wall "
        "time (transformers' includes loading the model, the server's excludes its start), on a machine "
        "shared with other jobs: not a speed comparison."
    )
    cmd = "python benches/bench_lm_eval.py " + " ".join(sys.argv[1:])
    write_section(SECTION, cmd.strip(), body, heading=HEADING)
    print(f"wrote section {SECTION!r} of benches/RESULTS.md ({machine()})")


if __name__ == "__main__":
    main()
