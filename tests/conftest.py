"""Shared pytest setup: the `gpu` marker, device parametrization and a per-test seed.

A test that takes a `device` argument runs on "cpu" and on every visible CUDA device ("cuda:0", ...); the CUDA cases
carry the `gpu` marker (select them with `-m gpu`, drop them with `-m "not gpu"`) and show up as skipped when no GPU
is visible. A test that takes `gpu_device` runs on the CUDA devices only.
"""
import importlib.util
import os
import sys

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("fused_ops") is None:  # not installed: use the in-tree package (after a build)
    sys.path.insert(0, os.path.join(_ROOT, "python"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped when torch.cuda.is_available() is False)")


def _cuda_params():
    if not torch.cuda.is_available():
        return [pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skip(reason="no CUDA device")])]
    return [pytest.param(f"cuda:{i}", id=f"cuda{i}", marks=pytest.mark.gpu) for i in range(torch.cuda.device_count())]


#: every device a device-parametrized test runs on, as pytest params
DEVICES = [pytest.param("cpu", id="cpu")] + _cuda_params()
#: the CUDA devices only
GPU_DEVICES = _cuda_params()


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)
    if "gpu_device" in metafunc.fixturenames:
        metafunc.parametrize("gpu_device", GPU_DEVICES)


@pytest.fixture(autouse=True)
def seed():
    """Seeds torch (CPU and all CUDA devices) before every test so failures reproduce; yields the seed."""
    torch.manual_seed(1234)
    yield 1234
