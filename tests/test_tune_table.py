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


def _rec(m, n, cfg, ms, kernel=K, dev="GPU X", k=4096):
    return {"device": dev, "cc": 90, "kernel": kernel, "family": "half", "op": "linear",
            "shape": f"M{m}_N{n}_K{k}", "m": m, "n": n, "k": k, "config": cfg, "ms": ms, "err": 1e-3}


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
    # the run's provenance, as data: the table's steps, then this run's (device, date, aot.tune arguments)
    assert new["origin"][:-1] == table["origin"]
    assert new["origin"][-1]["device"] == "GPU X" and new["origin"][-1]["command"] == ["--x"]


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


def test_a_design_flips_on_or_off_only_when_clearly_faster_or_slower():
    """The gather-in-GEMM design against gather copy + TMA kernel (1.1 here) within the keep margin keeps the table's
    choice: on stays on at 1.5% slower, off stays off at 1.5% faster; beyond the margin it flips."""
    G = "routed_linear_gather_tma_kernel"
    cases = {256: 1.1 * 1.015, 512: 1.1 / 1.015, 1024: 1.1 * 1.05, 2048: 1.1 / 1.05}
    recs = []
    for m, hybrid in cases.items():
        recs += [_rec(m, 4096, A, 1.0), _rec(m, 4096, A, hybrid, kernel=G), _rec(m, 4096, "gather copy", 0.1, kernel=G)]
    table = ct.load(90)
    table["kernels"][G]["half"] = [dict(_e(A), max_m=256), {"max_m": 512, "off": True}, dict(_e(A), max_m=1024),
                                   {"off": True}]
    ms = sorted(cases)
    new = tune.write_table("/dev/null", table, _done(recs), ["linear", "linear_gather"], ms, 90, "GPU X", [])
    pick = {m: ct.cfg_str(ct.pick(new, G, "half", m)) for m in ms}
    assert pick == {256: A, 512: "off", 1024: "off", 2048: A}, pick


def _e(cfg):
    """The table entry of a config name such as A."""
    blk, g, w, st = cfg.split("_")
    return {"block": [int(v) for v in blk.split("x")], "group": int(g[1:]), "warps": int(w[1:]), "stages": int(st[1:])}


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


def _linear(new):
    return [({f: e[f] for f in ("max_n", "max_k", "max_m") if f in e}, ct.cfg_str(e))
            for e in new["kernels"][K]["half"]]


def test_a_shape_class_gets_its_own_buckets_where_its_best_configs_differ():
    """Narrow N (1280) prefers C at m = 256 where the wide shapes prefer A: the class n<=2048 gets its own buckets;
    the class k<=1024 (whose shapes' best equals the general winner) does not."""
    recs = []
    for m in (256, 4096):
        for n in (4096, 6144):
            recs += [_rec(m, n, A, 1.0), _rec(m, n, C, 1.5)]
        recs += [_rec(m, 1280, A, 2.0 if m == 256 else 1.0), _rec(m, 1280, C, 1.0 if m == 256 else 1.3)]
        recs += [_rec(m, 8192, A, 1.0, k=1024), _rec(m, 8192, C, 1.4, k=1024)]
    base = ct.load(90)  # a table without classes: its general buckets only
    base["kernels"][K]["half"] = [e for e in base["kernels"][K]["half"] if ct.shape_class(e) == ct.GENERAL]
    new = tune.write_table("/dev/null", base, _done(recs), ["linear"], [256, 4096], 90, "GPU X", [],
                           tune.parse_classes("n<=2048;k<=1024"))
    kept_below = [(dict(max_m=e["max_m"]), ct.cfg_str(e)) for e in base["kernels"][K]["half"]
                  if e.get("max_m", 1 << 30) < 256]
    assert kept_below  # the decode buckets: m not measured in this run, kept from the table
    with_class = [(dict(max_n=2048, **b), c) for b, c in kept_below]
    assert _linear(new) == with_class + [({"max_n": 2048, "max_m": 256}, C), ({"max_n": 2048}, A)] + kept_below + [
        ({}, A)]
    # the shape of the class picks its class's config, the others the general one
    assert ct.cfg_str(ct.pick(new, K, "half", 200, 1280, 8192)) == C
    assert ct.cfg_str(ct.pick(new, K, "half", 200, 8192, 1024)) == A


def test_a_retune_without_classes_keeps_the_tables_classes():
    table = ct.load(90)
    assert set(tune.table_classes(table, [K, "routed_linear_gather_tma_kernel"])) >= {(2048, None, None),
                                                                                      (None, 1024, None)}
    assert tune.table_classes(table, ["routed_swiglu_tma_kernel"]) == [(4096, None, None)]
    assert tune.table_classes(table, ["routed_grad_weight_tma_kernel"]) == [(2048, None, None)]


def test_classes_are_parsed_narrow_first():
    assert tune.parse_classes("n<=2048; k<=1024;n<=2048,k<=512") == [(2048, None, None), (None, 1024, None),
                                                                     (2048, 512, None)]
    assert tune.parse_classes("n<=2048,t;f") == [(2048, None, True), (None, None, False)]
    assert tune.parse_classes("") == []
    for bad in ("n<2048", "m<=256", "n<=0", "n<=2048,n<=1024", "t,f", "x"):
        with pytest.raises(SystemExit, match="--classes"):
            tune.parse_classes(bad)


def test_matrix_models_give_the_matrix_projections():
    """--models matrix: the projections of benchmarks/bench_matrix.py's models (GQA QKV widths, the down
    projection for the linear kernel that runs it), so the tuner measures what the matrix reports."""
    names = tune.model_names("matrix")
    assert "llama3-70b-tp8" in names and "cogvlm2-19b" in names
    assert tune.projections("linear_gather", "llama3-70b-tp8") == [(1280, 8192), (8192, 1024)]
    assert tune.projections("linear", "llama3-8b") == [(6144, 4096), (4096, 4096), (4096, 14336)]
    assert tune.projections("swiglu_pair", "qwen2.5-7b") == [(18944, 3584)]
    # the linear kernel's table entry also serves the grad-input GEMM (W transposed): measured as "_t" shapes
    s = tune.shapes("linear", [256], ["llama3-70b-tp8"], grad_input=True)
    assert (256, 1024, 8192, "dual_t") in s and (256, 8192, 1280, "dual_t") in s
    assert all(r == "dual" for *_, r in tune.shapes("linear", [256], ["llama3-70b-tp8"]))  # opt-in
    assert tune.shape_str("linear", (256, 1024, 8192, "dual_t")) == "M256_N1024_K8192_t"
    assert tune._shape_nk("M256_N1024_K8192_t") == (1024, 8192)
    with pytest.raises(SystemExit, match="unknown --models"):
        tune.model_names("7b,gpt5")


def test_decode_tiles_are_not_measured_at_prefill_m():
    e16, e128 = {"block": [16, 64, 256]}, {"block": [128, 256, 64]}
    assert tune.fits_m(K, e16, 64) and not tune.fits_m(K, e16, 256) and tune.fits_m(K, e128, 256)
    assert tune.fits_m("routed_grad_weight_tma_kernel", {"block": [16, 64, 32]}, 4096)  # BN x BK x BR: no row tile


def test_passes_keep_each_configs_fastest_and_a_failure_in_any_pass(tmp_path):
    f = tmp_path / "r.jsonl"
    recs = [dict(_rec(16, 4096, A, 1.2), **{"pass": 1}), dict(_rec(16, 4096, A, 1.0), **{"pass": 2}),
            _rec(16, 4096, B, 0.9), dict(_rec(16, 4096, B, None), **{"pass": 2}),
            _rec(16, 4096, C, 2.0)]  # no "pass": the first (files written before passes existed)
    f.write_text("\n".join(json.dumps(r) for r in recs))
    done = tune.load_results(str(f), "GPU X")
    assert {c: done[(K, "M16_N4096_K4096", c)]["ms"] for c in (A, B, C)} == {A: 1.0, B: None, C: 2.0}


_LATER_PASS = r"""
import sys
sys.path.insert(0, sys.argv[1])
from aot import tune
prob = tune.Problem("linear", "routed_linear_tma_kernel", 256, 256, 256)
cfg = {"block": [128, 128, 64], "group": 8, "warps": 4, "stages": 3}
assert prob.time(cfg, 3) > 0  # no error() before it: the Problem allocates its outputs when it is made
assert prob.error(cfg) < 2e-2
# the grad-input orientation (W transposed) is checked against its own float64 reference
t = tune.Problem("linear", "routed_linear_tma_kernel", 256, 384, 256, "dual_t")
assert t.error(cfg) < 2e-2 and t.cublas_ms(3) > 0
print("ok")
"""


@pytest.mark.gpu
def test_a_later_pass_times_without_checking_first():
    """Pass 2 times configs that pass 1 checked: its Problem has not run error() (which poisons the outputs). In a
    fresh process without TRITON_INTERPRET (interpreter tests may have set it here): compiled kernels are timed."""
    import subprocess
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _LATER_PASS, ROOT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_the_shipped_tables_record_their_origin_as_data():
    """Every table's origin is a list of steps (config_table.validate checks their fields): each step's command is an
    argument list `python -m aot.tune` accepts, and sm90.json's measured steps name the device they ran on."""
    for arch in (80, 89, 90):
        for step in ct.load(arch)["origin"]:
            if step["command"] is not None:
                tune.parser().parse_args(step["command"])  # SystemExit on an argument aot.tune does not take
                assert step["device"], step
    with pytest.raises(ValueError, match="origin"):
        ct.validate(dict(ct.load(80), origin="reasoned defaults"))  # prose is not provenance


def test_the_shipped_sm90_table_is_what_its_measurements_give():
    """aot/configs/sm90.json's entries are the offline re-tunes of aot/configs/sm90.measurements.jsonl by the --offline
    commands of its origin's steps, applied in order starting from the table itself (each to the table the one before
    it wrote; one command per device's run: the file holds H100 and H200 records): the shipped table is reproducible
    from the raw log (and the re-tunes are stable: no config within the keep margin flips). Each step's device is the
    one whose records its command reads."""
    table = ct.load(90)
    steps = [s for s in table["origin"] if s["command"] and "--offline" in s["command"]]
    assert len(steps) >= 2, "the H100 re-tune and the H200 ones"
    new = table
    for step in steps:
        argv = list(step["command"])  # aot.tune's arguments; the results file is named from the repository root
        i = argv.index("--results") + 1
        argv[i] = os.path.join(ROOT, argv[i])
        assert tune.offline_device(tune.parser().parse_args(argv))[1] == step["device"], step
        new, done = tune.offline_retune(argv, new)
        assert done, f"no records for {step}"
    assert new["kernels"] == table["kernels"]


def test_the_shipped_rope_configs_are_what_their_measurements_give():
    """sm90.json's rope_kernel entries (one per heads-per-row class) are the offline re-tune of the rope records of
    aot/configs/sm90.measurements.jsonl (their own device's), and the classes are found from each record's heads per
    token row (q + k)."""
    table = ct.load(90)
    results = os.path.join(ROOT, "aot", "configs", "sm90.measurements.jsonl")
    recs = [json.loads(line) for line in open(results) if '"rope_kernel"' in line]
    cases = tune._rope_cases()  # shape -> (s, b, q heads, k heads, ...)
    assert recs and all(r["n"] == cases[r["shape"]][2] + cases[r["shape"]][3] for r in recs)
    done = tune.load_results(results, recs[0]["device"])
    done = {key: r for key, r in done.items() if key[0] == "rope_kernel"}
    new = tune.write_table("/dev/null", table, done, ["rope"], [1], 90, recs[0]["device"], [])
    assert new["kernels"]["rope_kernel"] == table["kernels"]["rope_kernel"]
    assert [e.get("max_n") for e in new["kernels"]["rope_kernel"]["all"]] == [16, None]


def test_offline_device_picks_that_devices_records(tmp_path):
    """`aot.tune --offline --device NAME`: a results file with two cards' runs is re-tuned from NAME's records only
    (without --device, from the first record's card)."""
    import subprocess
    recs = []
    for shape in tune.shapes("linear", [16], tune.model_names("7b"), False):
        for dev, fast in (("GPU X", A), ("GPU Y", B)):
            for cfg in (A, B):
                r = _rec(16, shape[1], cfg, 1.0 if cfg == fast else 2.0, dev=dev, k=shape[2])
                r["shape"] = tune.shape_str("linear", shape)
                recs.append(r)
    results = tmp_path / "r.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in recs))
    for device, want in ((None, A), ("GPU Y", B)):
        out = tmp_path / "t.json"
        cmd = [sys.executable, "-m", "aot.tune", "--offline", "--results", str(results), "--ops", "linear",
               "--ms", "16", "--models", "7b", "--classes", "", "--write", str(out)]
        r = subprocess.run(cmd + (["--device", device] if device else []), cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        new = json.loads(out.read_text())
        assert ct.cfg_str(ct.pick(new, K, "half", 16, 4096, 4096)) == want, device
