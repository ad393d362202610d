import pytest


def pytest_configure(config):
    # Keep torch to the two cores this project is sized for; import lazily so torch-free tests stay torch-free.
    try:
        import torch
    except ImportError:  # the worker-only environment
        return
    torch.set_num_threads(2)


@pytest.fixture
def rng_seed():
    return 1234
