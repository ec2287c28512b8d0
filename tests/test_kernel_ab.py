"""benchmarks/kernel_ab.py without a GPU: the other tree's kernels imported under their own package name, the cells
it measures, the launch arguments of a table config."""
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kernel_ab  # noqa: E402

pytest.importorskip("triton")


def test_load_base_imports_the_other_tree_as_its_own_package(tmp_path):
    shutil.copytree(os.path.join(ROOT, "kernels"), tmp_path / "tree" / "kernels")
    gather, tma, gw = kernel_ab.load_base(str(tmp_path / "tree"), str(tmp_path / "pkgs"))
    import kernels.gemm_tma as ours
    assert gather.__name__ == "kernels_base.gemm_gather_tma" and tma.__name__ == "kernels_base.gemm_tma"
    assert gw.__name__ == "kernels_base.grad_weight"
    assert tma.launch_routed_linear_tma is not ours.launch_routed_linear_tma
    # the base kernels use their own helpers, not this tree's
    assert sys.modules["kernels_base.gemm_tiles"] is not sys.modules["kernels.gemm_tiles"]
    for name in os.listdir(tmp_path / "pkgs" / "kernels_base"):
        text = (tmp_path / "pkgs" / "kernels_base" / name).read_text()
        assert "from kernels." not in text and "import kernels." not in text, name


def test_load_base_needs_a_kernels_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="no kernels package"):
        kernel_ab.load_base(str(tmp_path), str(tmp_path / "pkgs"))


def test_cells_cover_the_projections_in_both_orientations():
    models = {"m": dict(H=64, I=96, hq=4, hk=2, d=16)}
    got = kernel_ab.cells(models, [256, 1024], ["rand50", "span"], ["fwd", "gi", "gw"])
    assert len(got) == 2 * (2 + 3 + 4) * 2  # M x (fwd: qkv, o; gi: qkv, o, gate/up; gw: those and down) x masks
    fwd = {(c[2], c[4], c[5]) for c in got if c[0] == "fwd"}
    gi = {(c[2], c[4], c[5]) for c in got if c[0] == "gi"}
    gw = {(c[2], c[4], c[5]) for c in got if c[0] == "gw"}
    qkv = (4 + 2 * 2) * 16
    assert fwd == {("qkv", qkv, 64), ("o", 64, 64)}
    # grad-input: n = the weight's in-features, the reduction its out-features
    assert gi == {("qkv", 64, qkv), ("o", 64, 64), ("gate_up", 64, 96)}
    # weight gradients: the weight's [out-features, in-features]
    assert gw == {("qkv", qkv, 64), ("o", 64, 64), ("gate_up", 96, 64), ("down", 64, 96)}


def test_launch_kwargs_apply_a_forced_key_over_the_table_config():
    cfg = {"block": [128, 256, 64], "group": 8, "warps": 8, "stages": 3, "flatten": True, "split": 2}
    kw = kernel_ab.launch_kwargs(cfg, 132)
    assert kw == dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3, FLATTEN=True, SPLIT_TAIL=2,
                      STREAM_K=0, num_programs=132)
    forced = kernel_ab.launch_kwargs(cfg, 132, {"split": 0, "stream_k": 1})
    assert forced["SPLIT_TAIL"] == 0 and forced["STREAM_K"] == 1 and cfg["split"] == 2
