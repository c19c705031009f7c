"""The attack suite's harness checked on a server that is not attacked: what it measures at
rest, and that its checks fail when they must (a wrong honest text, a lost block, a health
the test did not expect)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from harness import Attacks  # noqa: E402

from pagedkv.server.launch import ServerProcess  # noqa: E402

FLAGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-blocks", "64", "--max-model-len", "256"]


def test_a_harmless_attack_passes_every_check_and_is_measured(server: ServerProcess) -> None:
    attacks = Attacks(server.url)
    report = attacks.run("harmless", lambda: attacks.honest_request()[0])
    assert report.result == attacks.honest_text
    assert report.honest_s and report.quiet_s > 0 and report.ratio > 0
    assert report.health["status"] == "ok" and report.health["dead"] == []
    state = attacks.invariants(server.url)
    assert state["num_used_blocks"] == 0 and state["num_blocks"] == 64, state


def test_the_checks_fail_when_they_must(server: ServerProcess) -> None:
    attacks = Attacks(server.url)
    attacks.honest_text += " (not what the model says)"
    with pytest.raises(AssertionError, match="the honest client got"):
        attacks.run("wrong-text", lambda: None)
    with pytest.raises(AssertionError, match="/health says 'ok'"):
        attacks.check_health("degraded")
    with pytest.raises(AssertionError, match="got no answer"):
        Attacks(server.url).run("hangs", lambda: __import__("time").sleep(3), attack_timeout=0.5)
