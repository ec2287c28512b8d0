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
