"""The kernel config tables (aot/configs/sm<arch>.json): their checks, what the AOT manifest compiles from them, and
that the C++ runtime picks the same bucket as the table says (no GPU needed: the lookup takes the compute capability
as an argument). Every shipped config is also run under the Triton interpreter (tests/test_gemm_interp.py,
tests/test_rope_interp.py)."""
import copy
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fused_ops  # noqa: E402
from aot import config_table as ct  # noqa: E402
from aot import manifest  # noqa: E402

TABLES = {arch: ct.load(arch) for arch in manifest.ARCHS}
MS = [0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 1000, 1024, 1025, 4096, 4097, 16384, 16385, 1 << 22]


def test_shipped_tables_are_valid_and_canonical():
    for arch, table in TABLES.items():
        assert table["arch"] == arch
        assert table["origin"], f"sm_{arch}: say how the table was made"
        with open(ct.path(arch)) as f:  # the format `python -m aot.tune --write` produces: clean diffs on re-tune
            assert f.read() == ct.dumps(table), f"{ct.path(arch)} is not in canonical form (ct.dumps)"
        assert json.loads(ct.dumps(table)) == table


def test_every_table_covers_every_launched_kernel_and_family():
    pointer = ["routed_linear_kernel", "routed_swiglu_kernel", "routed_grad_weight_kernel"]
    for arch, table in TABLES.items():
        assert ct.buckets(table, "rope_kernel", "all")
        for k in pointer + (["routed_linear_tma_kernel", "routed_grad_weight_tma_kernel"] if arch == 90 else []):
            for fam in ("half", "tf32", "ieee"):
                assert ct.buckets(table, k, fam), f"sm_{arch}: no {k}/{fam}"
        if arch == 90:
            assert ct.buckets(table, "routed_swiglu_tma_kernel", "half")


def _bad(mutate):
    t = copy.deepcopy(TABLES[90])
    mutate(t)
    return t


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t["kernels"].update(nope_kernel={"half": []}), "unknown kernel 'nope_kernel'"),
    (lambda t: t["kernels"]["routed_linear_kernel"].update(fp8=t["kernels"]["routed_linear_kernel"]["half"]),
     "unknown family 'fp8'"),
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].update(block=[96, 128, 64]), "3 powers of two"),
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].update(block=[256, 128, 64]),
     "must divide the routing alignment 128"),
    (lambda t: t["kernels"]["routed_grad_weight_kernel"]["half"][0].update(block=[128, 128, 256]),
     "block[2] = 256 must divide"),
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].update(warps=3), "'warps' must be"),
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].update(stages=0), "'stages' must be"),
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].update(max_m=64), "the last bucket"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].pop("max_m"), "needs an integer 'max_m'"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"].insert(1, dict(
        t["kernels"]["routed_linear_tma_kernel"]["half"][0])), "above the previous one"),  # same max_m twice
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].update(tile=[1]), "unknown fields ['tile']"),
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].pop("group"), "'group'"),
    (lambda t: t["kernels"].clear(), "'kernels' must be a non-empty object"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"].insert(0, {"max_m": 1, "off": True}),
     "only an alternative-design kernel"),
    (lambda t: t["kernels"]["routed_swiglu_pair_tma_kernel"]["half"][0].update(block=[128, 128, 64]),
     "an \"off\" bucket has only max_m"),
    (lambda t: t["kernels"]["routed_swiglu_pair_tma_kernel"]["half"][1].update(block=[128, 8, 64]),
     "block[1] = 8 must be at least 16"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].update(block=[16, 8, 256], split=2),
     "block[1] = 8 must be at least 16"),
    (lambda t: t["kernels"]["routed_linear_gather_tma_kernel"]["half"][0].update(block=[16, 8, 256], split=2),
     "block[1] = 8 must be at least 16"),
    (lambda t: t["kernels"]["routed_swiglu_tma_kernel"]["half"][0].update(split=2), "'split' is 2, 4 or 8"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].update(split=True), "'split' is 2, 4 or 8"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].update(split=3), "'split' is 2, 4 or 8"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].update(block=[128, 32, 64], split=8),
     "block[1] = 32 must be at least 64"),
    (lambda t: t["kernels"]["routed_linear_kernel"]["half"][0].update(flatten=True), "'flatten' is a bool, and only"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].update(stream_k=True), "'stream_k' is 1 or 2"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].update(stream_k=3), "'stream_k' is 1 or 2"),
    (lambda t: t["kernels"]["routed_swiglu_tma_kernel"]["half"][0].update(stream_k=1), "'stream_k' is 1 or 2"),
    (lambda t: t["kernels"]["routed_linear_tma_kernel"]["half"][0].update(flatten=1), "'flatten' is a bool, and only"),
])
def test_validate_rejects_bad_tables(mutate, message):
    with pytest.raises(ValueError, match=None) as e:
        ct.validate(_bad(mutate), "t.json")
    assert message in str(e.value) and "t.json" in str(e.value)


# The lookups of the sm_90 table need a build that holds sm_90 (the default on CI and on an sm_90 machine).
needs_sm90 = pytest.mark.skipif("sm_90" not in fused_ops.built_archs(), reason="this build holds no sm_90 table")


@needs_sm90
@pytest.mark.parametrize("kernel", sorted(ct.OPTIONAL))
def test_off_buckets_turn_the_alternative_design_off_at_run_time(kernel):
    """Every bucket of an alternative-design kernel reads back from the C++ lookup as the table says: "off" where
    the other design runs, its config elsewhere."""
    buckets = ct.buckets(TABLES[90], kernel, "half")
    assert buckets, f"the sm_90 table lists no buckets for {kernel}"
    for e in buckets:
        m = e.get("max_m", 1 << 30)
        assert fused_ops.kernel_config(kernel, "half", m, 90, n=e.get("max_n"), k=e.get("max_k"),
                                       w_transposed=e.get("w_transposed")) == ct.cfg_str(e)


_A = {"block": [128, 256, 64], "group": 8, "warps": 8, "stages": 3}
_B = {"block": [64, 64, 128], "group": 8, "warps": 4, "stages": 4}
_C = {"block": [128, 128, 64], "group": 8, "warps": 8, "stages": 4}


def _classed(buckets):
    t = copy.deepcopy(TABLES[90])
    t["kernels"]["routed_linear_tma_kernel"]["half"] = buckets
    return t


def test_shape_classes_pick_the_first_class_that_admits_the_shape():
    """A class (max_n / max_k) serves only the GEMMs within its bounds; the general class takes the rest and every
    lookup that does not know the shape."""
    t = ct.validate(_classed([dict(_B, max_n=2048, max_m=1024), dict(_C, max_n=2048),
                              dict(_C, max_k=1024),
                              dict(_B, max_m=64), dict(_A)]))
    pick = lambda m, n=None, k=None: ct.cfg_str(ct.pick(t, "routed_linear_tma_kernel", "half", m, n, k))  # noqa
    assert pick(256, 1280, 8192) == pick(1024, 2048, 4096) == ct.cfg_str(_B)  # narrow N, its own m buckets
    assert pick(1025, 1280, 8192) == ct.cfg_str(_C)
    assert pick(256, 8192, 1024) == ct.cfg_str(_C)  # short K
    assert pick(256, 2049, 4096) == pick(256) == ct.cfg_str(_A)  # the general class; unknown shape: general
    assert pick(64, 4096, 4096) == pick(64) == ct.cfg_str(_B)
    assert ct.class_str((2048, None, None)) == "n<=2048" and ct.class_str(ct.GENERAL) == "general"
    assert ct.class_str((2048, None, True)) == "n<=2048,t" and ct.class_str((None, 1024, False)) == "k<=1024,f"


@pytest.mark.parametrize("buckets, message", [
    ([dict(_B, max_n=2048, max_m=256), dict(_A)], "the last bucket of a class"),  # a class without its open bucket
    ([dict(_B, max_n=2048), dict(_A, max_k=1024)], "the last class must be the general one"),
    ([dict(_B, max_n=2048), dict(_C, max_k=512), dict(_B, max_n=2048), dict(_A)], "appears twice"),
    ([dict(_B, max_n=4096), dict(_C, max_n=2048), dict(_A)], "is never taken: n<=4096 before it"),
    ([dict(_B, max_n=0), dict(_A)], "'max_n' must be a positive integer"),
    ([dict(_B, w_transposed=1), dict(_A)], "'w_transposed' is a bool"),
    ([dict(_B, w_transposed=True), dict(_C, max_n=2048, w_transposed=True), dict(_A)], "is never taken: t before it"),
    ([dict(_B, max_n=2048, max_m=256), dict(_C, max_n=2048, max_m=128), dict(_B, max_n=2048), dict(_A)],
     "above the previous one"),
])
def test_shape_classes_are_checked(buckets, message):
    with pytest.raises(ValueError) as e:
        ct.validate(_classed(buckets), "t.json")
    assert message in str(e.value)


def test_an_orientation_class_serves_only_its_orientation():
    """w_transposed: the linear GEMMs serve the forward and, with W transposed, the grad-input; a class may key on it.
    A lookup that does not know the orientation takes the classes of either."""
    t = ct.validate(_classed([dict(_B, max_n=2048, w_transposed=True), dict(_C, max_n=2048), dict(_A)]))
    pick = lambda wt: ct.cfg_str(ct.pick(t, "routed_linear_tma_kernel", "half", 512, 1024, 8192, wt))  # noqa: E731
    assert pick(True) == ct.cfg_str(_B) and pick(False) == pick(None) == ct.cfg_str(_C)
    g = copy.deepcopy(TABLES[90])
    g["kernels"]["routed_linear_gather_tma_kernel"]["half"] = [dict(_B, w_transposed=False), dict(_A)]
    with pytest.raises(ValueError, match="'w_transposed' is a bool, and only for routed_linear_kernel"):
        ct.validate(g)  # the gather GEMM serves the forward only


def test_classes_of_an_optional_kernel_may_turn_it_off_and_rope_has_only_heads():
    t = copy.deepcopy(TABLES[90])
    t["kernels"]["routed_linear_gather_tma_kernel"]["half"] = [{"max_n": 2048, "off": True}, dict(_A)]
    ct.validate(t)
    assert ct.pick(t, "routed_linear_gather_tma_kernel", "half", 512, 1280, 8192) == {"max_n": 2048, "off": True}
    t["kernels"]["rope_kernel"]["all"] = [{"max_n": 16, "block": [8, 4, 64], "warps": 2, "stages": 1},
                                          {"block": [1, 8, 64], "warps": 2, "stages": 1}]
    ct.validate(t)  # rope's heads-per-row class
    assert ct.pick(t, "rope_kernel", "all", 4096, 9, None)["block"] == [8, 4, 64]
    assert ct.pick(t, "rope_kernel", "all", 4096, 40, None)["block"] == [1, 8, 64]
    t["kernels"]["rope_kernel"]["all"][0]["max_k"] = 64
    with pytest.raises(ValueError, match="rope_kernel's only shape class is max_n"):
        ct.validate(t)
    t["kernels"]["rope_kernel"]["all"] = [{"block": [2048, 1, 64], "warps": 2, "stages": 1}]
    with pytest.raises(ValueError, match="BLOCK_T"):
        ct.validate(t)


def test_route_blocks_restart_at_each_class():
    """The gather GEMM's ROUTE_BLOCK sizes follow each class's own m ranges: a config used only by a class for
    m <= 1024 needs the one-block routing sizes of 1 .. 1024, whatever the general class's buckets are."""
    from kernels.routing import one_block_sizes
    t = copy.deepcopy(TABLES[90])
    t["kernels"]["routed_linear_gather_tma_kernel"]["half"] = [dict(_B, max_n=2048, max_m=1024),
                                                               dict(_C, max_n=2048), dict(_A, max_m=8192),
                                                               dict(_C)]
    ct.validate(t)
    orig = manifest.table
    try:
        manifest.table = lambda arch: t if arch == 90 else ct.load(arch)
        got = set(manifest.route_blocks("routed_linear_gather_tma_kernel", "half", _B))
    finally:
        manifest.table = orig
    assert got == {0} | set(one_block_sizes(0, 1024))


def test_tma_kernels_only_in_the_sm90_table():
    t = copy.deepcopy(TABLES[80])
    t["kernels"]["routed_linear_tma_kernel"] = TABLES[90]["kernels"]["routed_linear_tma_kernel"]
    with pytest.raises(ValueError, match="only an sm_90 table"):
        ct.validate(t)


def test_missing_table_names_the_file():
    with pytest.raises(FileNotFoundError, match="sm100.json"):
        ct.load(100)


def test_manifest_compiles_every_config_for_its_architectures():
    variants = manifest.variants()
    compiled = {}
    for v in variants:
        if "cfg" in v.key:
            compiled.setdefault((v.name, v.key["cfg"]), set()).update(v.archs)
    for arch, table in TABLES.items():
        for kernel, fams in table["kernels"].items():
            for fam, buckets in fams.items():
                for e in buckets:
                    if e.get("off"):  # nothing compiled: the launcher takes the other design
                        continue
                    archs = compiled.get((kernel, ct.cfg_str(e)), set())
                    assert arch in archs, f"sm_{arch} {kernel}/{fam} {ct.cfg_str(e)} is not compiled"
    # and nothing is compiled for an architecture whose table does not list it
    for (kernel, cfg), archs in compiled.items():
        for arch in archs:
            listed = {ct.cfg_str(e) for fams in [TABLES[arch]["kernels"].get(kernel, {})] for b in fams.values()
                      for e in b}
            assert cfg in listed, f"{kernel} {cfg} compiled for sm_{arch} but not in its table"


@pytest.mark.parametrize("kernel, align", [("routed_linear_gather_tma_kernel", ct.ROUTING_ALIGN),
                                           ("routed_swiglu_gather_tma_kernel", 1)])
def test_gather_kernels_compile_the_route_block_of_every_m(kernel, align):
    """The gather TMA kernels route a deferred routing themselves: for every m a bucket serves up to the one-block
    limit, the launcher asks for route=one_block_size(m) with that bucket's config (csrc/ops/routed_gemm.cpp), and
    for route=0 at every m when the op was given a routing (the route op's)."""
    from kernels.routing import ONE_BLOCK, one_block_size
    keys = {(v.key["dtype"], v.key["prec"], v.key["cfg"], v.key["route"], v.key["align"]) for v in manifest.variants()
            if v.name == kernel}
    table = TABLES[90]
    for dt, prec in manifest.GEMM_UNITS:
        fam = ct.family(dt, prec)
        if not table["kernels"].get(kernel, {}).get(fam):
            continue
        for m in sorted({1, 2, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 1024, 1025, 4095, ONE_BLOCK}):
            e = ct.pick(table, kernel, fam, m)
            if e.get("off"):
                continue
            for route in (one_block_size(m), 0):
                want = (dt, prec, ct.cfg_str(e), route, align)
                assert want in keys, f"{kernel}: no variant {want} for m = {m}"


def test_variant_meta_matches_its_config():
    for v in manifest.variants():
        if "cfg" not in v.key:
            continue
        cfg = v.key["cfg"]
        flat, split, sk = bool(v.meta.get("FLATTEN")), int(v.meta.get("SPLIT_TAIL", 0)), int(v.meta.get("STREAM_K", 0))
        assert cfg.endswith(f"_w{v.num_warps}_s{v.num_stages}" + ("_f" if flat else "")
                            + ct.SPLIT_SUFFIX.get(split, "") + ct.STREAM_K_SUFFIX.get(sk, ""))
        names = ("BLOCK_N", "BLOCK_K", "BLOCK_R") if "grad_weight" in v.name else (
            ("BLOCK_T", "BLOCK_H", "BLOCK_HALF") if v.name == "rope_kernel" else (
                ("BLOCK_M", "BLOCK_N", "HEAD_D") if v.name == "decode_attention_kernel" else
                ("BLOCK_M", "BLOCK_N", "BLOCK_K")))
        assert cfg.startswith("x".join(str(v.meta[n]) for n in names))


# Compute capabilities whose table the runtime picks (the launcher's image choice): the built architecture of the same
# major not above it, else the lowest built architecture (whose PTX the driver compiles).
CCS = (80, 86, 87, 89, 90, 100, 120)


def table_arch(cc, built):
    same = [a for a in built if a // 10 == cc // 10 and a <= cc]
    return max(same) if same else (min(built) if min(built) <= cc else None)


def built_arch_list():
    return [int(a[len("sm_"):]) for a in fused_ops.built_archs().split(" (")[0].split(", ")]


@pytest.mark.parametrize("cc", CCS)
def test_runtime_lookup_matches_the_tables(cc):
    """torch.ops.fused.kernel_config (the launchers' lookup) == aot.config_table.pick for every bucket edge, on the
    table of the built architecture a device of compute capability cc runs."""
    arch = table_arch(cc, built_arch_list())
    if arch is None:
        pytest.skip(f"no architecture of this build ({fused_ops.built_archs()}) runs on sm_{cc}")
    table = TABLES[arch]
    for kernel, fams in table["kernels"].items():
        for fam, buckets in fams.items():
            # every class edge on n and k, and None: a lookup that does not know the shape (the general class)
            ns, ks = ({None, 1} | {b[f] + d for b in buckets if f in b for d in (0, 1)} for f in ("max_n", "max_k"))
            for m in MS:
                for n in ns:
                    for k in ks:
                        for wt in (None, False, True):
                            assert fused_ops.kernel_config(kernel, fam, m, cc, n=n, k=k, w_transposed=wt) == \
                                ct.cfg_str(ct.pick(table, kernel, fam, m, n, k, wt)), (kernel, fam, m, n, k, wt, cc)


def test_runtime_lookup_errors_name_what_is_missing():
    with pytest.raises((ValueError, RuntimeError), match="routed_linear_tma_kernel .*half.* sm_80"):
        fused_ops.kernel_config("routed_linear_tma_kernel", "half", 16, 86)  # no TMA kernels off sm_90
    with pytest.raises((ValueError, RuntimeError), match="routed_swiglu_tma_kernel .*ieee"):
        fused_ops.kernel_config("routed_swiglu_tma_kernel", "ieee", 16, 90)  # no exact-fp32 TMA swiglu
    with pytest.raises((ValueError, RuntimeError), match="no built architecture runs on it"):
        fused_ops.kernel_config("rope_kernel", "all", 1, 75)


_FLATTEN_COMPILE = r"""
import copy, json, sys, tempfile
sys.path.insert(0, sys.argv[1])
from aot import compile as aot_compile, config_table as ct, manifest
t = copy.deepcopy(ct.load(90))
for kernel in ("routed_linear_gather_tma_kernel", "routed_swiglu_pair_tma_kernel", "routed_linear_tma_kernel",
               "routed_swiglu_pair_bwd_tma_kernel"):
    t["kernels"][kernel]["half"][-1]["flatten"] = True  # shipped flattened or not: each kernel compiles flattened
ct.validate(t)
manifest.table = lambda arch: t if arch == 90 else ct.load(arch)
picked = {}
for v in manifest.variants():
    if v.key.get("cfg", "").endswith("_f") and v.key.get("dtype") == "bf16":
        picked.setdefault(v.name, v)
assert set(picked) == {"routed_linear_gather_tma_kernel", "routed_swiglu_pair_tma_kernel",
                       "routed_swiglu_pair_bwd_tma_kernel", "routed_linear_tma_kernel"}, sorted(picked)
with tempfile.TemporaryDirectory() as d:
    for name, v in sorted(picked.items()):
        assert v.meta["FLATTEN"] is True
        aot_compile._compile_one((v, 90, d, name))
        meta = json.load(open(f"{d}/{name}.json"))
        print(name, v.key["cfg"], "shared", meta["shared"])
"""


def test_flattened_configs_compile_for_sm90():
    """A config with "flatten": true compiles (cross-compiled for sm_90, no GPU) into a variant whose key ends in _f
    and whose FLATTEN constexpr is set. In a fresh process: interpreter tests may have set TRITON_INTERPRET here."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _FLATTEN_COMPILE, ROOT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "routed_swiglu_pair_tma_kernel 128x128x64_g8_w8_s4_f shared" in r.stdout, r.stdout


@needs_sm90
def test_shape_classes_can_be_turned_off_for_a_benchmark():
    """FUSED_SHAPE_CLASSES=0 (read once per process): every lookup takes the general class."""
    import subprocess
    code = ("import fused_ops; print(fused_ops.kernel_config('routed_linear_tma_kernel', 'half', 256, 90, n=1280, "
            "k=8192), fused_ops.kernel_config('routed_linear_tma_kernel', 'half', 256, 90))")
    general = ct.cfg_str(ct.pick(TABLES[90], "routed_linear_tma_kernel", "half", 256))
    narrow = ct.cfg_str(ct.pick(TABLES[90], "routed_linear_tma_kernel", "half", 256, 1280, 8192))
    assert narrow != general, "the shipped sm_90 table has a narrow-N class for m = 256"
    for env, want in (("0", f"{general} {general}"), ("1", f"{narrow} {general}")):
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, FUSED_SHAPE_CLASSES=env),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.split() == want.split(), r.stdout + r.stderr
