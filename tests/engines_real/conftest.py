"""Fixtures for the real-engine tests: one server per test module (startup is 20-70 s).

Every test here is marked `engine`; the venvs come from `install.py` (run by .ci/setup).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# The helpers hold assertions of their own: rewritten, a failure shows its values.
pytest.register_assert_rewrite("tests.engines_real.agents", "tests.engines_real.rig")

from tests.engines_real import install, servers  # noqa: E402 (after the rewrite hook)
from tests.support.ports import free_port  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)


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


def _serve(name: str, model: Path, logs: Path) -> Iterator[servers.EngineServer]:
    python = install.install(install.ENGINES[name])
    port = free_port()
    if name == "vllm":
        command, env = servers.vllm_command(python, model, port), servers.VLLM_ENV
    else:
        command, env = servers.sglang_command(python, model, port), servers.SGLANG_ENV
    with servers.running(name, command, env, port, logs / f"{name}.log") as server:
        yield server


@pytest.fixture(scope="module")
def vllm_server(
    engine_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[servers.EngineServer]:
    yield from _serve("vllm", engine_model, tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="module")
def sglang_server(
    engine_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[servers.EngineServer]:
    yield from _serve("sglang", engine_model, tmp_path_factory.mktemp("sglang"))
