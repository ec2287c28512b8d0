"""The fuzzer (tests/fuzz.py): a fixed-seed run of random cases against the CPU float64 path on every GPU, the
compute-sanitizer subset, and on the CPU a short run of the harness itself plus checks that it can fail.

GPU tier: FUSED_FUZZ_CASES cases (default 2000) from seed FUSED_FUZZ_SEED (default 1); a failure prints the seed and
the replay command. The soak (`python tests/fuzz.py --minutes 30 ...`) and the sanitizer commands are in
docs/design.md's "Determinism and threads" section.
"""
import os
import time

import pytest
import torch

import fuzz

CASES = int(os.environ.get("FUSED_FUZZ_CASES", "2000"))
SEED = int(os.environ.get("FUSED_FUZZ_SEED", "1"))


def test_fuzz_gpu(gpu_device):
    t0 = time.time()
    n, fails = fuzz.run_many(range(SEED, SEED + CASES), gpu_device)
    took = time.time() - t0
    print(f"fuzz on {gpu_device}: {n} cases from seed {SEED} in {took:.1f} s, {len(fails)} failures")
    assert n == CASES
    assert not fails, f"{len(fails)} of {n} cases failed:\n" + "\n".join(fails[:20])


def test_sanitizer_subset_gpu(gpu_device):
    # What compute-sanitizer runs (memcheck, racecheck): it must pass without the sanitizer too.
    n, fails = fuzz.run_many(fuzz.SANITIZER_SEEDS, gpu_device, tiny=True)
    assert n == len(fuzz.SANITIZER_SEEDS) and not fails, "\n".join(fails)


def test_harness_on_cpu():
    # The harness end to end on the CPU path (CI has no GPU): tiny cases of every op family.
    seeds = range(SEED, SEED + 60)
    ops = {fuzz.draw_case(s, "cpu", tiny=True)["op"] for s in seeds}
    assert ops == {"rope", "route", "linear_dual", "ffn"}
    n, fails = fuzz.run_many(seeds, "cpu", tiny=True)
    assert n == 60 and not fails, "\n".join(fails)


def test_a_case_is_a_function_of_its_seed():
    for seed in (3, 77, 12345):
        a, b = fuzz.draw_case(seed, "cuda"), fuzz.draw_case(seed, "cuda")
        assert a == b
        ia, ib = fuzz.build(a, "cpu"), fuzz.build(b, "cpu")
        assert ia.ref.keys() == ib.ref.keys()
        assert all(torch.equal(ia.ref[k], ib.ref[k]) for k in ia.ref)


def _first(op, mode=None):
    return next(s for s in range(1, 10_000) if fuzz.draw_case(s, "cpu", tiny=True)["op"] == op
                and (mode is None or fuzz.draw_case(s, "cpu", tiny=True).get("mode") == mode)
                and min(fuzz.draw_case(s, "cpu", tiny=True).get("lead", [1])) > 0)


@pytest.mark.parametrize("fault", ["wrong_value", "nondeterministic", "wrong_dtype", "missing_output"])
def test_harness_reports_faults(monkeypatch, fault):
    # A result that is off by 5%, differs between two runs, has the wrong dtype or lacks an output must fail.
    seed = _first("ffn", "autograd")
    c = fuzz.draw_case(seed, "cpu", tiny=True)
    real, runs = fuzz.call, []

    def faulty(case, T, on_device):
        out = real(case, T, on_device)
        if not on_device:
            return out
        runs.append(1)
        name, t = out[0]
        if fault == "wrong_value":
            t = t * 1.05
        elif fault == "nondeterministic" and len(runs) == 2:
            t = t.clone()
            t.view(-1)[0] = t.view(-1)[0] + 1
        elif fault == "wrong_dtype":
            t = t.double()
        elif fault == "missing_output":
            return out[1:]
        return [(name, t)] + out[1:]

    assert not fuzz.run_case(c, "cpu"), "the unmodified case must pass"
    monkeypatch.setattr(fuzz, "call", faulty)
    fails = fuzz.run_case(c, "cpu")
    assert fails, f"{fault} was not reported"


def test_replay_command_line(capsys):
    seed = _first("linear_dual")
    assert fuzz.main(["--device", "cpu", "--replay", str(seed), "--tiny"]) == 0
    out = capsys.readouterr().out
    assert f"seed {seed} on cpu" in out and "PASS" in out
