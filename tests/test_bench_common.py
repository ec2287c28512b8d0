"""benchmarks/common.py's helpers without a GPU: a fake torch and a fake fused_ops stand in for the device calls."""
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import common  # noqa: E402


class _Ctx:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log.append(f"enter {self.name}")

    def __exit__(self, *exc):
        self.log.append(f"exit {self.name}")


def _fake_torch(log):
    class Stream:
        def wait_stream(self, other):
            pass

    cuda = types.SimpleNamespace(Stream=Stream, current_stream=Stream, synchronize=lambda: None,
                                 CUDAGraph=lambda: "graph", stream=lambda s: _Ctx(log, "side"),
                                 graph=lambda g: _Ctx(log, "capture"))
    return types.SimpleNamespace(cuda=cuda)


def test_graph_of_returns_the_graph_and_its_call_count():
    # graph_of is a plain function (a stray contextmanager decorator once made it return a context manager)
    log, calls = [], []
    g, n = common.graph_of(_fake_torch(log), [lambda: calls.append("a"), lambda: calls.append("b")], passes=3)
    assert (g, n) == ("graph", 6)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up on the side stream, then the captured passes
    assert log == ["enter side", "exit side", "enter capture", "exit capture"]


def test_programmatic_launch_restores_the_setting(monkeypatch):
    state = {"on": True}

    def set_pl(enabled):
        prev, state["on"] = state["on"], enabled
        return prev
    monkeypatch.setitem(sys.modules, "fused_ops", types.SimpleNamespace(set_programmatic_launch=set_pl))
    with common.programmatic_launch(False):
        assert state["on"] is False
    assert state["on"] is True


def test_matrix_cells_draw_their_own_masks():
    """benchmarks/bench_matrix.py seeds each cell's generator from its shape, M and mask: a cell gets the same mask
    whichever cells ran before it (a run of a few ops measures the cells of a full run), and two cells differ."""
    import torch

    import bench_matrix as bm

    def mask(shape, M):
        return bm.make_mask("rand50", M, bm.cell_generator(shape, M, "rand50"), "cpu")
    first = mask("llama3-8b.qkv", 256)
    mask("llama3-8b.o", 1024)  # another cell's draws in between
    assert torch.equal(mask("llama3-8b.qkv", 256), first)
    assert not torch.equal(mask("llama3-8b.o", 256), first)
