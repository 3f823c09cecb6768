import pytest
from ops_fakes import FakeCollector


@pytest.fixture
def collector():
    with FakeCollector() as fake:
        yield fake
