"""The AOT step's build choices (aot/compile.py), CPU tier: which architectures a build compiles, where PTX is kept,
and the compressed images the library embeds."""
import os
import sys
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from aot import compile as aot_compile  # noqa: E402
from aot import manifest  # noqa: E402


@pytest.mark.parametrize("spec, want", [("all", (80, 89, 90)), ("90", (90,)), ("90,80", (80, 90)),
                                        ("80;90", (80, 90)), (" 89 ", (89,))])
def test_resolve_archs_lists(spec, want):
    assert aot_compile.resolve_archs(spec) == want


def test_resolve_archs_auto_is_the_visible_gpus_else_every_supported_one(monkeypatch):
    monkeypatch.setattr(aot_compile, "_visible_archs", lambda: ())
    assert aot_compile.resolve_archs("auto") == manifest.PORTABLE_ARCHS
    monkeypatch.setattr(aot_compile, "_visible_archs", lambda: (90,))
    assert aot_compile.resolve_archs("auto") == (90,)
    monkeypatch.setenv("FUSED_ARCHS", "")
    assert aot_compile.resolve_archs() == (90,)  # unset or empty: auto
    monkeypatch.setenv("FUSED_ARCHS", "80")
    assert aot_compile.resolve_archs() == (80,)


@pytest.mark.parametrize("spec", ["75", "80,100", "sm_90", ","])
def test_resolve_archs_names_what_is_wrong(spec):
    with pytest.raises(ValueError, match="FUSED_ARCHS"):
        aot_compile.resolve_archs(spec)


def test_ptx_only_where_a_newer_gpu_can_compile_it():
    assert aot_compile._keep_ptx(80, [80, 89, 90])
    assert not aot_compile._keep_ptx(89, [80, 89, 90])
    assert not aot_compile._keep_ptx(90, [90])  # sm_90a code: no other architecture compiles it


def test_compressed_images_inflate_to_the_bytes_the_driver_loads(tmp_path):
    cubin, ptx = tmp_path / "k.cubin", tmp_path / "k.ptx"
    cubin.write_bytes(os.urandom(1000) + bytes(3000))
    ptx.write_text(".version 8.0\n.target sm_80\n" * 50)
    for path, want in ((cubin, cubin.read_bytes()), (ptx, ptx.read_bytes() + b"\0")):  # PTX: NUL-terminated
        z = aot_compile._compressed(str(path))
        with open(z, "rb") as f:
            assert zlib.decompress(f.read()) == want


def _records(times):
    """tune.load_results' form: (kernel, shape, cfg) -> record, from {(m, cfg): ms} on one N x K shape."""
    kernel = "routed_linear_tma_kernel"
    return {(kernel, f"M{m}_N4096_K4096", c): {"m": m, "n": 4096, "k": 4096, "ms": ms} for (m, c), ms in times.items()}


def test_fold_report_folds_a_config_only_within_the_tolerance():
    from aot import fold_report
    small = {"block": [64, 64, 128], "group": 8, "warps": 4, "stages": 4}
    large = {"block": [128, 256, 64], "group": 8, "warps": 8, "stages": 3}
    table = {"kernels": {"routed_linear_tma_kernel": {"half": [dict(small, max_m=256), dict(large)]}}}
    a, b = "64x64x128_g8_w4_s4", "128x256x64_g8_w8_s3"
    # the large config's bucket (m > 256) costs 1% more on the small one; the small one's costs 50% more on the large
    done = _records({(256, a): 1.0, (256, b): 1.5, (2048, a): 1.01, (2048, b): 1.0})
    folds, kept = fold_report.fold(done, "routed_linear_tma_kernel", "half", table, 1.015)
    assert [(c, t) for c, t, _ in folds] == [(b, [a])] and kept == [a]
    assert abs(folds[0][2] - 1.01) < 1e-9
    assert fold_report.fold(done, "routed_linear_tma_kernel", "half", table, 1.005) == ([], [a, b])
    # a bucket whose m was not measured keeps its config (the large one's, m > 256), whatever the tolerance
    partial = _records({(256, a): 1.0, (256, b): 1.5})
    folds, kept = fold_report.fold(partial, "routed_linear_tma_kernel", "half", table, 2.0)
    assert [c for c, _, _ in folds] == [a] and kept == [b]


_SM90_SAMPLE = r"""
import os, sys, tempfile
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, sys.argv[1])
from aot import compile as aot_compile, manifest
picked = {}
for v in manifest.variants():  # one variant of every kernel the sm_90 build compiles: bf16 where it has a dtype
    if 90 in v.archs and v.key.get("dtype", "bf16") == "bf16":
        picked.setdefault(v.name, v)
print("kernels", " ".join(sorted(picked)))
with tempfile.TemporaryDirectory() as d, ProcessPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
    for key in pool.map(aot_compile._compile_one, [(v, 90, d, n) for n, v in sorted(picked.items())]):
        print("compiled", key)
"""


def test_every_sm90_kernel_cross_compiles_in_a_build_without_sm90():
    """A build without sm_90 (the test command on a machine with no GPU builds sm_80 only) still compiles one variant
    of every kernel of the sm_90 build, the TMA kernels among them, for sm_90 with no GPU. In a fresh process:
    interpreter tests may have set TRITON_INTERPRET here."""
    import subprocess

    import fused_ops
    if "sm_90" in fused_ops.built_archs():
        pytest.skip("this build compiled every sm_90 variant")
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _SM90_SAMPLE, ROOT], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    kernels = r.stdout.splitlines()[0].split()[1:]
    assert "routed_linear_tma_kernel" in kernels and "routed_swiglu_pair_bwd_tma_kernel" in kernels, kernels
    assert sorted(line.split()[1] for line in r.stdout.splitlines()[1:]) == sorted(kernels), r.stdout
