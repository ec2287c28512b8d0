"""Issue 33's check, reproducible: on each rank, threads calling the ops at once against the rank's sequential run,
before and after a collective.

    torchrun --standalone --nproc_per_node=2 scripts/thread_check.py            # the issue's setup: 2 GPUs, NCCL
    python scripts/thread_check.py                                              # one process, world size 1

Each rank (one GPU: cuda:LOCAL_RANK) builds the issue's inputs (M = 777, H = 1024, I = 2816, bf16, a 40% mask, the
dual expert's weights as views of [2, R, C]; tests/workload.py), runs the calls sequentially twice (they must agree
bitwise), then for every combination of the options below starts --threads threads that run the calls --iters times
each and compare every output with torch.equal. Phase "pre" runs before any collective, "post" after
dist.all_gather_object on the NCCL group (which creates the communicator, its streams and its memory), as in the
issue. The combinations vary what could matter: the threads' stream (their own, or the device's default stream that
they then share), their current device ("fresh": what a new thread has, device 0, which on rank 1 is not the tensors'
device; "same": torch.cuda.set_device(local_rank) in the thread), programmatic dependent launch on / off, NaN in the
allocator's free blocks (a kernel reading memory nobody wrote then shows NaN), the thread building its own inputs
(other addresses), and the calls ("issue": rope_fwd, linear_dual, ffn, ffn routing=, ffn_backward; "all": every op).

Every line names the rank, phase and combination; a mismatch lists per output the differing elements, their ulps and
rows / tiles (workload.describe), and the combination is repeated --repeat times to give a failure rate. Prints
RANK_OK or RANK_FAIL per rank; the exit status is 1 when anything differed. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 unless set).
"""
import argparse
import itertools
import os
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fused_ops  # noqa: E402
import workload as wl  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    lst = lambda s: s.split(",")  # noqa: E731
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument("--phases", type=lst, default=["pre", "post"])
    ap.add_argument("--ops", type=lst, default=["issue", "all"])
    ap.add_argument("--streams", type=lst, default=["default", "own"])
    ap.add_argument("--currents", type=lst, default=["fresh", "same"])
    ap.add_argument("--pdl", type=lst, default=["on", "off"])
    ap.add_argument("--poison", type=lst, default=["off", "on"])
    ap.add_argument("--own-inputs", type=lst, default=["off"])
    ap.add_argument("--repeat", type=int, default=3, help="reruns of a combination that failed (its failure rate)")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--cpu", action="store_true", help="a dry run of the script on the CPU (gloo, tiny sizes)")
    return ap.parse_args()


def init_group(backend, cuda):
    """(rank, world, local_rank); under torchrun its env:// rendezvous, else a one-process group on a FileStore."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)  # the main thread only, as in the issue; new threads start on device 0
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), local


def main():
    a = parse()
    cuda = not a.cpu
    backend = a.backend if cuda else "gloo"
    rank, world, local = init_group(backend, cuda)
    dev = f"cuda:{local}" if cuda else "cpu"
    sizes = wl.ISSUE if cuda else wl.TINY
    say = lambda *m: print(f"[rank {rank}/{world} {dev}]", *m, flush=True)  # noqa: E731
    what = (f"NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(local)}" if cuda else "CPU dry run")
    say(f"torch {torch.__version__}, {what}, backend {backend}, library {fused_ops.library_path}, "
        f"FUSED_GEMM_TMA={os.environ.get('FUSED_GEMM_TMA')}, sizes {sizes}, seed {a.seed}, "
        f"{a.threads} threads x {a.iters} iterations")
    ops = {"issue": wl.issue_ops, "all": wl.run_ops}
    failed = 0
    for phase in a.phases:
        if phase == "post":
            objs = [None] * world
            dist.all_gather_object(objs, {"rank": rank, "pid": os.getpid()})
            say("all_gather_object done:", objs)
        for name in a.ops:
            inputs, refs = wl.sequential([dev], sizes, seed=a.seed, ops=ops[name])
            combos = itertools.product(a.streams, a.currents, a.pdl, a.poison, a.own_inputs)
            for stream, current, pdl, poison, own in combos:
                fused_ops.set_programmatic_launch(pdl == "on")
                plans = [wl.plan(dev, stream, current, own == "on", poison == "on") for _ in range(a.threads)]
                tag = f"phase {phase} ops {name} stream {stream} current {current} pdl {pdl} poison {poison} own {own}"
                t0 = time.time()
                fails = wl.run_threads(plans, inputs, refs, a.iters, sizes, seed=a.seed, ops=ops[name])
                if not fails:
                    say(f"{tag}: OK ({time.time() - t0:.1f} s)")
                    continue
                failed += 1
                say(f"{tag}: FAIL, {len(fails)} of {a.threads} threads differ:\n" + "\n".join(fails))
                again = [bool(wl.run_threads(plans, inputs, refs, a.iters, sizes, seed=a.seed, ops=ops[name]))
                         for _ in range(a.repeat)]
                say(f"{tag}: reruns failing {sum(again)} of {a.repeat}")
    fused_ops.set_programmatic_launch(True)
    dist.barrier(device_ids=[local]) if backend == "nccl" else dist.barrier()
    say("RANK_OK" if not failed else f"RANK_FAIL {failed} combinations")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
