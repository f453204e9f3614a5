"""Test setup: 8 virtual CPU devices for JAX context parallelism, XLA's backend without its
expensive optimisations, and GPU-test skipping."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# On a GPU, JAX would otherwise take 75% of its memory at first use and starve the torch tests.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The tests compile many small programs once each: XLA's backend (LLVM) optimisations cost more
# than they save there (the suite takes about 11% less time on two CPU cores without them; HLO
# passes such as fusion still run). On a GPU the XLA code around the Pallas kernels is built the
# same way; the kernels compile through their own pipelines. Set to 0 to test optimised builds.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        import jax

        return jax.default_backend() == "gpu"
    except Exception:
        try:
            import torch

            return torch.cuda.is_available()
        except Exception:
            return False


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` on machines without a CUDA GPU."""
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small CPU problems: one intra-op torch thread is fastest and avoids oversubscribing CI's
    cores; the module's tests run with it, and the count is restored after them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
