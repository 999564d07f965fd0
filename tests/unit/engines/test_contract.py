"""The engine contract against the reference engine and SGLang's and vLLM's recorded fakes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_contract import EngineContract
from tests.unit.engines.backends import BACKENDS, InProcess


@pytest.fixture(params=sorted(BACKENDS))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[InProcess]:
    under_test = BACKENDS[request.param](tmp_path)
    yield under_test
    under_test.close()


class TestEngineContract(EngineContract):
    pass
