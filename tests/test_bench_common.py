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


def test_matrix_diff_pairs_cells_in_their_own_terms(tmp_path, capsys):
    """benchmarks/matrix_diff.py: NEW over OLD per cell present in both, a compute cell by its ratio to cuBLAS, a
    bandwidth cell by the inverse of its fraction of copy bandwidth (both: below 1 is faster); per-range geometric
    means; a cell only one run has is counted, not compared; different cards and run-order masks are warned about."""
    import json

    import matrix_diff

    def cell(op, M, value, kind="ratio_to_cublas", shape="s"):
        return {"op": op, "shape": shape, "M": M, "mask": "rand50", "value": value, "kind": kind}
    old = {"meta": {"device": "A", "cell_masks": True},
           "cells": [cell("linear_fwd", 4096, 1.2), cell("linear_fwd", 1024, 1.1),
                     cell("linear_fwd", 1, 0.5, "copy_bw_fraction"), cell("ffn_fwd", 256, 1.3)]}
    new = {"meta": {"device": "A", "cell_masks": True},
           "cells": [cell("linear_fwd", 4096, 1.08), cell("linear_fwd", 1024, 1.1),
                     cell("linear_fwd", 1, 0.625, "copy_bw_fraction"), cell("ffn_bwd", 256, 1.0)]}
    res, (only_old, only_new) = matrix_diff.compare(old, new)
    ratio = res[("linear_fwd", "ratio_to_cublas")]
    assert abs(ratio["ranges"]["4096+"] - 0.9) < 1e-9 and abs(ratio["ranges"]["256-2048"] - 1.0) < 1e-9
    assert abs(ratio["geomean"] - 0.9 ** 0.5) < 1e-9
    assert abs(res[("linear_fwd", "copy_bw_fraction")]["geomean"] - 0.8) < 1e-9  # 0.5 -> 0.625 of copy bandwidth
    assert [k[0] for k in only_old] == ["ffn_fwd"] and [k[0] for k in only_new] == ["ffn_bwd"]
    assert matrix_diff.warnings(old, new) == []
    new["meta"] = {"device": "B"}
    assert len(matrix_diff.warnings(old, new)) == 2  # another card, masks in run order
    (tmp_path / "o.json").write_text(json.dumps(old))
    (tmp_path / "n.json").write_text(json.dumps(new))
    assert matrix_diff.main([str(tmp_path / "o.json"), str(tmp_path / "n.json")]) == 0
    out = capsys.readouterr().out
    assert "linear_fwd" in out and "cells only in OLD: 1, only in NEW: 1" in out
