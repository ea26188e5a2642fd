import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skips the GPU tests without a GPU, and the tests that build C++ where builds cannot
    run here, with what is missing (codegen.jit.toolchain_problem, the check a build
    itself makes)."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    builds = [item for item in items if "build" in item.keywords]
    if builds:
        from codegen.jit import toolchain_problem

        problem = toolchain_problem()
        if problem is not None:
            for item in builds:
                item.add_marker(pytest.mark.skip(reason=f"builds C++: {problem}"))


def ints(*shape, dtype=torch.float32, device="cpu", lo=-4, hi=5):
    """Integer-valued random floats: products and sums of these are exact in fp32."""
    return torch.randint(lo, hi, shape, device=device).to(dtype)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One build cache for the session (CI points CODEGEN_CACHE_DIR at the checkout)."""
    import os
    from pathlib import Path

    if os.environ.get("CODEGEN_CACHE_DIR"):
        return Path(os.environ["CODEGEN_CACHE_DIR"])
    path = tmp_path_factory.mktemp("codegen-cache")
    os.environ["CODEGEN_CACHE_DIR"] = str(path)
    return path


@pytest.fixture
def no_tf32():
    """GEMMs in full fp32 while the test runs (exact comparisons against torch), restored
    after."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved
