import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def ints(*shape, dtype=torch.float32, device="cpu", lo=-4, hi=5):
    """Integer-valued random floats: products and sums of these are exact in fp32."""
    return torch.randint(lo, hi, shape, device=device).to(dtype)
