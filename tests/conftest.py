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
    # xdist's controller (pytest-xdist >= 3.6) would reorder the files by test count: keep _LONGEST_FIRST's order
    if getattr(config.option, "dist", "no") == "loadfile" and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


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


# The longest files, longest first (seconds on 2 xdist workers without a GPU, fresh caches, 2026-11-28: 171, 93, 78,
# 56; every other file takes under 25). Under `--dist loadfile` (scripts/test.sh without a GPU) files go out to the
# workers in the workers' collection order (xdist's reordering turned off in pytest_configure), so these start first
# and the short files fill in after them: xdist's own order (most tests first) sent the 3-test CMake file last, and
# one worker ran it alone for its last 64 s.
_LONGEST_FIRST = ["test_gemm_interp.py", "test_cmake_build.py", "test_deploy_pt2.py", "test_docs.py"]


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker (one process): the order stays pytest's
        return
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: pytest's order otherwise


@pytest.fixture(autouse=True)
def seed():
    """Seeds torch (CPU and all CUDA devices) before every test so failures reproduce; yields the seed."""
    torch.manual_seed(1234)
    yield 1234
