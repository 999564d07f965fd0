"""Fixtures for the real-engine tests: one engine server at a time (startup is 20-70 s).

Every test here is marked `engine`; the venvs come from `install.py` (run by .ci/setup).
A test names its engine by parametrizing `engine_server` indirectly ("vllm", "sglang").
The server is session-scoped and the tests are ordered by engine, so each server starts
once, the two never share the machine's cores, and the contract's test that kills its
engine runs last for that engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# The helpers hold assertions of their own: rewritten, a failure shows its values.
pytest.register_assert_rewrite(
    "tests.engines_real.agents", "tests.engines_real.rig", "tests.engines_real.serving"
)

from tests.engines_real import install, servers  # noqa: E402 (after the rewrite hook)
from tests.support.engine_contract import KILLS_ENGINE  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

ENGINE_ORDER = ("sglang", "vllm")  # SGLang starts faster: its failures show sooner


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture parameter
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)
    items.sort(key=_engine_order)  # stable: other tiers' items keep their order, first


def _engine_order(item: pytest.Item) -> tuple[int, bool]:
    if item.get_closest_marker("engine") is None:
        return -1, False
    callspec = getattr(item, "callspec", None)
    engine = callspec.params.get("engine_server") if callspec is not None else None
    rank = ENGINE_ORDER.index(engine) if engine in ENGINE_ORDER else len(ENGINE_ORDER)
    return rank, getattr(item, "originalname", item.name) == KILLS_ENGINE


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The engine servers keep the machine's cores busy; the test's own torch work (the
    reference model's greedy decoding) is tiny, and with several threads it waits on the
    servers' threads: 160 tokens took 50 s instead of 0.2 s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return servers.write_model(tmp_path_factory.mktemp("engine-model"))


@pytest.fixture(scope="session")
def engine_server(
    request: pytest.FixtureRequest, engine_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[servers.EngineServer]:
    """The engine named by the test's indirect parameter; pytest stops one engine's server
    before it starts the other's (a session fixture's parameter changes once per engine)."""
    name: str = request.param
    python = install.install(install.ENGINES[name])
    port = free_port()
    if name == "vllm":
        command, env = servers.vllm_command(python, engine_model, port), servers.VLLM_ENV
    else:
        command, env = servers.sglang_command(python, engine_model, port), servers.SGLANG_ENV
    logs = tmp_path_factory.mktemp(name)
    with servers.running(name, command, env, port, logs / f"{name}.log") as server:
        yield server
