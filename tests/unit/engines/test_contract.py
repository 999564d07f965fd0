"""The engine contract against the reference engine and SGLang's and vLLM's recorded fakes;
the memory contract against those that release memory (the reference engine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_contract import EngineContract, MemoryContract
from tests.unit.engines.backends import BACKENDS, InProcess


@pytest.fixture(params=sorted(BACKENDS))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[InProcess]:
    under_test = BACKENDS[request.param](tmp_path)
    yield under_test
    under_test.close()


class TestEngineContract(EngineContract):
    pass


class TestMemoryContract(MemoryContract):
    @pytest.fixture(params=sorted(n for n, kind in BACKENDS.items() if kind.releases_memory))
    def engine(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[InProcess]:
        under_test = BACKENDS[request.param](tmp_path)
        yield under_test
        under_test.close()
