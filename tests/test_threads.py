"""Many Python threads calling every op at once must give bitwise the results of a sequential run (issue 33).

Each thread repeats tests/workload.py's mix (rope_fwd, rope_fwd_qk, rope_bwd thd, route, linear_dual forward and
backward, ffn dual / separate weights / routing= / single / odd sizes and their backward, autograd) on one input set
per device and compares every output with torch.equal against the main thread's sequential run, which must itself
repeat bitwise. Threads differ in what users do differently: their own stream or the (shared) default stream, a
current device that is the tensors' own, another one, or whatever a fresh thread has (device 0), inputs shared or
built by the thread itself (other addresses), the allocator poisoned with NaN (a kernel that reads memory nobody
wrote shows NaN instead of plausible stale values).

Short by default (8 threads, 2 iterations); the issue's target: FUSED_THREADS=32 FUSED_THREAD_ITERS=100. Failures
name the seed, the thread's setup and iteration, and per output how many elements differ, by how many ulps, in which
token rows (vision / text) or weight tiles. The two-rank check of the issue itself (torchrun, NCCL, a collective
first) is scripts/thread_check.py, run here on two GPUs.
"""
import os
import subprocess
import sys
import threading
import traceback

import pytest
import torch
import torch.distributed

import workload as wl
from fresh_process import TESTS, run_fresh

THREADS = int(os.environ.get("FUSED_THREADS", "8"))
ITERS = int(os.environ.get("FUSED_THREAD_ITERS", "2"))
SEED = int(os.environ.get("FUSED_THREAD_SEED", "33"))
ROOT = os.path.dirname(TESTS)



def gpu_test(f):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")(f))


def sequential(devices, sizes=wl.ISSUE):
    return wl.sequential(devices, sizes, seed=SEED)


def run_threads(plans, inputs, refs, iters=ITERS, sizes=wl.ISSUE):
    return wl.run_threads(plans, inputs, refs, iters, sizes, seed=SEED)


def plan(device, i, current="same", own_inputs=False, poison=False):
    """Odd threads on their own stream, even ones on the device's default stream (shared by all of them)."""
    return wl.plan(device, "own" if i % 2 else "default", current, own_inputs, poison)


def report(failures, what):
    head = f"{what}: seed {SEED}, {THREADS} threads x {ITERS} iterations; {len(failures)} threads failed"
    assert not failures, head + "\n" + "\n".join(failures)


def test_threads_cpu():
    # The CPU paths from 4 threads at once (tiny sizes, float32): also runs the harness itself in CI.
    inputs, refs = sequential(["cpu"], wl.TINY)
    plans = [wl.plan("cpu", own_inputs=i % 2 == 1) for i in range(4)]
    report(run_threads(plans, inputs, refs, iters=1, sizes=wl.TINY), "cpu")


@pytest.mark.parametrize("variant", ["shared_inputs", "own_inputs_poisoned"])
def test_threads_one_device(gpu_device, variant):
    inputs, refs = sequential([gpu_device])
    own = variant != "shared_inputs"
    plans = [plan(gpu_device, i, own_inputs=own, poison=own) for i in range(THREADS)]
    report(run_threads(plans, inputs, refs), f"{gpu_device} {variant}")


@gpu_test
def test_threads_all_devices():
    # Round robin over every visible device; half the threads stay on the device a fresh thread has (device 0),
    # which is not their tensors' for every device but the first (rank 1 of a torchrun job is in that situation).
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    inputs, refs = sequential(devices)
    plans = [plan(devices[i % len(devices)], i // len(devices), current="fresh" if i % 4 < 2 else "same")
             for i in range(THREADS)]
    report(run_threads(plans, inputs, refs), f"over {devices}")


@gpu_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (a current device that is not the "
                                                          "tensors')")
def test_threads_current_device_differs():
    devices = [f"cuda:{i}" for i in range(1, torch.cuda.device_count())]
    inputs, refs = sequential(devices)
    plans = [plan(devices[i % len(devices)], i, current=("fresh", "other")[i % 2], own_inputs=i % 3 == 0)
             for i in range(THREADS)]
    report(run_threads(plans, inputs, refs), "current device differs")


@gpu_test
def test_fresh_thread_rope_with_value_checks():
    # A fresh thread that has never used CUDA and whose current device is not the tensors': rope's checks of
    # cu_seqlens query the stream's capture state before the op's device guard (csrc/ops/torch_launch.cpp).
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    inp = wl.make_inputs(SEED, dev, wl.SMALL)
    want = torch.ops.fused.rope_bwd(inp["t_thd"], inp["freqs"], "thd", cu_seqlens=inp["cu"])
    got, errors = [], []

    def body():
        try:
            got.append(torch.ops.fused.rope_bwd(inp["t_thd"], inp["freqs"], "thd", cu_seqlens=inp["cu"]))
        except Exception:  # noqa: BLE001
            errors.append(traceback.format_exc())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert not errors, errors[0]
    assert torch.equal(got[0], want)


# The process group variants run in a fresh process: a process group cannot be torn down cleanly inside pytest.
PG_SCRIPT = """
import importlib.util, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r} + "/tests")
if importlib.util.find_spec("fused_ops") is None:  # not installed: the in-tree package (as tests/conftest.py does)
    sys.path.insert(0, {root!r} + "/python")
import test_threads as tt
store = dist.FileStore({store!r}, 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
objs = [None]
dist.all_gather_object(objs, {{"rank": 0}})
groups = ["gloo"]
if dist.is_nccl_available():
    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    dist.all_gather_object(objs, {{"rank": 0}}, group=nccl)  # creates the NCCL communicator, as in the issue
    t = torch.ones(4, device="cuda:0")
    dist.all_reduce(t, group=nccl)
    groups.append("nccl")
devices = [f"cuda:{{i}}" for i in range(torch.cuda.device_count())]
inputs, refs = tt.sequential(devices)
plans = [tt.plan(devices[i % len(devices)], i // len(devices), current="fresh" if i % 2 else "same")
         for i in range(tt.THREADS)]
failures = tt.run_threads(plans, inputs, refs)
print("GROUPS", groups)
print("\\n".join(failures) if failures else "OK")
dist.destroy_process_group()
"""


@gpu_test
def test_threads_after_collectives(tmp_path):
    code = PG_SCRIPT.format(root=ROOT, store=str(tmp_path / "store"))
    env = {"FUSED_THREADS": str(THREADS), "FUSED_THREAD_ITERS": str(ITERS), "NCCL_NVLS_ENABLE": "0"}
    r = run_fresh(code, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout[-6000:] + r.stderr[-4000:]
    groups = "GROUPS ['gloo', 'nccl']" if torch.distributed.is_nccl_available() else "GROUPS ['gloo']"
    assert groups in r.stdout, f"expected {groups}: {r.stdout[-2000:]}"


@gpu_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one rank per GPU)")
def test_thread_check_two_ranks():
    # The issue's own check: torchrun, one process per GPU, NCCL, all_gather_object, then 4 threads per rank; each
    # rank runs it before and after the collective (scripts/thread_check.py).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "scripts", "thread_check.py"), "--iters", str(ITERS), "--threads", "4"]
    if ITERS <= 2:  # the default tier: the issue's calls, PDL on, no poisoning (every combination: long runs)
        cmd += ["--ops", "issue", "--pdl", "on", "--poison", "off"]
    package_dir = os.path.dirname(os.path.dirname(wl.fused_ops.__file__))  # the fused_ops this process imported
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.pathsep.join(
        [package_dir, TESTS, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
    assert r.stdout.count("RANK_OK") == 2, r.stdout[-8000:]
