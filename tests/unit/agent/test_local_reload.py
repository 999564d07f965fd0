"""When the source agent reloads its Colocated engine from the held copy (`needs_reload`)."""

from __future__ import annotations

from weightsync.agent.local_reload import needs_reload
from weightsync.engines.base import EngineHealth


def test_an_engine_is_reloaded_only_when_healthy_and_not_serving_the_committed_version() -> None:
    serving = EngineHealth(True, 5, incarnation="a")
    assert not needs_reload(serving, 5, "a")
    assert needs_reload(EngineHealth(True, None, incarnation="b"), 5, "a")  # restarted
    assert needs_reload(EngineHealth(True, 4, incarnation="a"), 5, "a")  # missed a round
    assert needs_reload(EngineHealth(True, 5, torn=True, incarnation="a"), 5, "a")  # torn
    # Another process at the version (a reference engine started with a version label):
    # the slots it reads are not attached in it.
    assert needs_reload(EngineHealth(True, 5, incarnation="b"), 5, "a")
    # Engines that name no process (vLLM, SGLang) are judged by the version they report.
    assert not needs_reload(EngineHealth(True, 5), 5, None)
    assert needs_reload(EngineHealth(True, None), 5, None)
    # Down: nothing could load it; its own agent reports it.
    assert not needs_reload(EngineHealth(False, None, incarnation="b"), 5, "a")
