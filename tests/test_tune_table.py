"""aot/tune.py's bookkeeping without a GPU: resuming from a result file, choosing winners per m, merging buckets and
writing a valid table (the measuring itself runs on the GPU machine: scripts/gpu_job.sh step `tune`)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from aot import config_table as ct  # noqa: E402
from aot import tune  # noqa: E402

K = "routed_linear_tma_kernel"
A, B, C = "128x256x64_g8_w8_s3", "128x64x64_g8_w4_s4", "64x64x128_g8_w4_s4"


def _rec(m, n, cfg, ms, kernel=K, dev="GPU X"):
    return {"device": dev, "cc": 90, "kernel": kernel, "family": "half", "op": "linear",
            "shape": f"M{m}_N{n}_K4096", "m": m, "n": n, "k": 4096, "config": cfg, "ms": ms, "err": 1e-3}


def _done(recs):
    return {(r["kernel"], r["shape"], r["config"]): r for r in recs}


def test_winner_is_the_best_geometric_mean_over_shapes():
    # m=16: B is 2x faster on one shape and 10% slower on the other: geomean ratio sqrt(1.1) vs A's sqrt(2)
    recs = [_rec(16, 4096, A, 2.0), _rec(16, 4096, B, 1.0), _rec(16, 11008, A, 1.0), _rec(16, 11008, B, 1.1),
            _rec(16, 4096, "cuBLAS", 0.1)]
    w = tune.winners(_done(recs), K, [16])
    assert w[16][0] == B and w[16][1] == pytest.approx(1.1 ** 0.5)


def test_failed_or_wrong_configs_never_win():
    recs = [_rec(16, 4096, A, 2.0), _rec(16, 4096, B, None), _rec(16, 4096, C, 3.0),
            _rec(16, 11008, A, 1.0), _rec(16, 11008, B, 0.1), _rec(16, 11008, C, 1.5)]
    assert tune.winners(_done(recs), K, [16])[16][0] == A  # B failed on one shape; C is slower overall


def test_buckets_merge_and_the_last_is_open(tmp_path):
    recs = []
    for m, best in ((1, B), (16, B), (64, C), (256, A), (4096, A)):
        for cfg in (A, B, C):
            recs.append(_rec(m, 4096, cfg, 1.0 if cfg == best else 2.0))
    out = tmp_path / "sm90.json"
    table = ct.load(90)
    new = tune.write_table(str(out), table, _done(recs), ["linear"], [1, 16, 64, 256, 4096], 90, "GPU X", ["--x"])
    b = new["kernels"][K]["half"]
    assert [(e.get("max_m"), ct.cfg_str(e)) for e in b] == [(16, B), (64, C), (None, A)]
    assert json.loads(out.read_text()) == ct.validate(json.loads(out.read_text()))
    # what was not measured is kept
    assert new["kernels"]["routed_linear_tma_kernel"]["tf32"] == table["kernels"]["routed_linear_tma_kernel"]["tf32"]
    assert new["kernels"]["routed_swiglu_tma_kernel"] == table["kernels"]["routed_swiglu_tma_kernel"]
    assert "GPU X" in new["origin"]


def test_results_resume_per_device(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [_rec(16, 4096, A, 1.0), _rec(16, 4096, B, 2.0, dev="GPU Y")]))
    done = tune.load_results(str(f), "GPU X")
    assert list(done) == [(K, "M16_N4096_K4096", A)]


def test_candidates_include_the_tables_configs():
    table = ct.load(90)
    fam, cfgs = tune.candidates(K, [((64, 32, 128), 8, 4, 4)], table)
    assert fam == "half"
    assert set(cfgs) >= {ct.cfg_str(e) for e in ct.buckets(table, K, "half")} | {"64x32x128_g8_w4_s4"}


def test_shapes_cover_decode_to_prefill_and_the_model_sizes():
    s = tune.shapes("swiglu", [1, 16384], ["7b", "70b"])
    # decode m is measured with one expert too (the Llama MLP); prefill only with the dual-expert routing
    assert s == [(1, 11008, 4096, "dual"), (1, 11008, 4096, "single"), (1, 28672, 8192, "dual"),
                 (1, 28672, 8192, "single"), (16384, 11008, 4096, "dual"), (16384, 28672, 8192, "dual")]
    assert tune.shape_str("swiglu", s[1]) == "M1_N11008_K4096_single"
    # the gather-inside design serves two experts only
    assert all(r == "dual" for *_, r in tune.shapes("linear_gather", [1], ["7b"]))
    assert tune.table_arch(86) == 80 and tune.table_arch(89) == 89 and tune.table_arch(90) == 90


def test_the_current_config_stays_unless_clearly_beaten():
    recs = [_rec(16, 4096, A, 1.00), _rec(16, 4096, B, 1.015), _rec(64, 4096, A, 1.0), _rec(64, 4096, B, 1.05)]
    cur = lambda m: B  # noqa: E731  (the table's config for every m)
    w = tune.winners(_done(recs), K, [16, 64], cur)
    assert w[16][0] == B  # 1.5% slower than the best: noise, kept
    assert w[64][0] == A  # 5% slower: replaced


def test_the_gather_in_gemm_design_is_on_only_where_it_beats_gather_copy_plus_tma():
    G = "routed_linear_gather_tma_kernel"
    recs = []
    for m, hybrid in ((1, 2.0), (4096, 0.8)):  # the other design: 1.0 (TMA kernel) + 0.1 (gather copy)
        recs += [_rec(m, 4096, A, 1.0), _rec(m, 4096, A, hybrid, kernel=G), _rec(m, 4096, "gather copy", 0.1, kernel=G)]
    table = ct.load(90)
    new = tune.write_table("/dev/null", table, _done(recs), ["linear", "linear_gather"], [1, 4096], 90, "GPU X", [])
    b = new["kernels"][G]["half"]
    assert b[0] == {"max_m": 1, "off": True} and ct.cfg_str(b[1]) == A and "max_m" not in b[1]


def test_keep_merges_an_earlier_run_at_the_m_not_measured_again():
    old = _done([_rec(16, 4096, A, 1.0), _rec(4096, 4096, A, 2.0), _rec(4096, 4096, A, 9.0, kernel="other_kernel")])
    new = _done([_rec(16, 4096, B, 0.5)])
    done, ms = tune.merge_kept(new, old, [16], {K})
    assert ms == [16, 4096]
    assert set(done) == {(K, "M16_N4096_K4096", B), (K, "M4096_N4096_K4096", A)}  # old m=16 record dropped


def test_the_paired_gate_up_is_on_only_where_it_beats_the_two_mma_kernel():
    P, S, G = "routed_swiglu_pair_tma_kernel", "routed_swiglu_tma_kernel", "128x128x64_g8_w8_s4"
    recs = []
    for m, pair in ((1, 1.05), (4096, 0.9)):  # the kernel it replaces: 1.0, no gather copy added
        recs += [_rec(m, 4096, G, 1.0, kernel=S), _rec(m, 4096, G, pair, kernel=P)]
    new = tune.write_table("/dev/null", ct.load(90), _done(recs), ["swiglu", "swiglu_pair"], [1, 4096], 90, "GPU X", [])
    b = new["kernels"][P]["half"]
    assert b[0] == {"max_m": 1, "off": True} and ct.cfg_str(b[1]) == G and "max_m" not in b[1]
