"""Writes what the C++ examples (infer.cpp, train.cpp) load; README, "Deployment":

    block.pt             the FusedBlock of examples/block_model.py, scripted (torch.jit.script), float32, CPU
    block_reference.pt   its inputs, the float64 reference output, an upstream gradient and the float64 reference
                         gradients of x and of every parameter: a scripted module holding them as buffers, which C++
                         reads with torch::jit::load(...).named_buffers() (names: `x`, `grad_x`, `grad_proj_weight`...);
                         and inputs and float64 outputs at every length of block_model.LENGTHS (`len<tokens>_x`,
                         `_mask`, `_freqs`, `_out`: 1 to 8192 tokens), which the AOTInductor package serves
    block_cpu.pt2        with --aoti cpu: the block exported (torch.export, dynamic batch and sequence: one package for
                         every length) and compiled by AOTInductor for the CPU
    block_cuda.pt2       with --aoti cuda: the same for CUDA (needs a GPU here, at export time)
    decode_step.pt       examples/decode_step.py's DecodeStep (fused::decode_attention on a KV cache held as
                         buffers), scripted, float32, CPU
    decode_reference.pt  its starting caches, the inputs of two decode steps in a row (`qkv<i>`, `lens<i>`) and the
                         float64 reference outputs and caches after each (`out<i>`, `k_cache<i>`, `v_cache<i>`)

    python examples/cpp/export_model.py --out DIR [--aoti cpu|cuda]

It imports fused_ops, which registers the ops; with FUSED_OPS_LIBRARY=/path/libfused_ops.so it uses that library
(the CMake build's ctest runs it so, with the package from the source tree on PYTHONPATH).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from block_model import (LENGTHS, FusedBlock, dynamic_shapes, make_inputs, reference_forward,  # noqa: E402
                         reference_grads)  # (importing it imports fused_ops: the ops register)

NO_DEVICE = 77  # the exit status ctest reads as "skipped" (SKIP_RETURN_CODE)


class Tensors(torch.nn.Module):
    """A scripted container of named tensors, readable from C++ without Python."""

    def __init__(self, tensors):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t.detach().contiguous())

    def forward(self) -> int:  # TorchScript needs a method; C++ reads the buffers only
        return 0


def export_reference(out_dir):
    block = FusedBlock()
    x, mask, freqs = make_inputs(block)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    ref, grads = reference_grads(block, x, mask, freqs, grad_out)
    got = block(x, mask, freqs)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    if err > 1e-5:  # the model written below must be the one the reference describes
        raise SystemExit(f"export_model: the fused block differs from its reference in Python (rel. error {err:.2e})")
    scripted = torch.jit.script(block)
    scripted.save(os.path.join(out_dir, "block.pt"))
    tensors = {"x": x, "mask": mask, "freqs": freqs, "out": ref, "grad_out": grad_out}
    tensors.update({"grad_" + name.replace(".", "_"): g for name, g in grads.items()})
    params = {k: v.detach().double() for k, v in block.named_parameters()}
    for batch, seq in LENGTHS:  # (make_inputs draws the same parameters again: one seed)
        xl, maskl, freqsl = make_inputs(block, batch=batch, seq=seq)
        out = reference_forward(params, block.heads, xl.double(), maskl, freqsl.double())
        name = f"len{batch * seq}"
        tensors.update({name + "_x": xl, name + "_mask": maskl, name + "_freqs": freqsl, name + "_out": out})
    torch.jit.script(Tensors(tensors)).save(os.path.join(out_dir, "block_reference.pt"))
    print(f"export_model: wrote block.pt and block_reference.pt to {out_dir} (Python rel. error {err:.2e}; "
          f"{int(mask.sum())} of {mask.numel()} tokens vision)")


def export_decode(out_dir):
    from decode_step import DecodeStep, make_inputs, reference
    step = DecodeStep(batch=3, heads=8, kv_heads=2, head_dim=64, max_len=24)
    qkv, lens = make_inputs(step, tokens=2, room=2)
    tensors = {"k_cache": step.k_cache.clone(), "v_cache": step.v_cache.clone()}
    kc, vc = step.k_cache.double(), step.v_cache.double()
    for i in range(2):  # the second step attends what the first wrote
        x, n = qkv * (1.0 - 0.5 * i), lens + 2 * i
        out, kc, vc = reference(kc, vc, x, n, step.heads)
        tensors.update({f"qkv{i}": x, f"lens{i}": n, f"out{i}": out, f"k_cache{i}": kc, f"v_cache{i}": vc})
    torch.jit.script(step).save(os.path.join(out_dir, "decode_step.pt"))
    torch.jit.script(Tensors(tensors)).save(os.path.join(out_dir, "decode_reference.pt"))
    print(f"export_model: wrote decode_step.pt and decode_reference.pt to {out_dir}")


def export_aoti(out_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        print("export_model: SKIP: no CUDA device visible, no CUDA AOTInductor package written")
        sys.exit(NO_DEVICE)
    block = FusedBlock(device=device)
    inputs = make_inputs(block, device=device)
    exported = torch.export.export(block, inputs, dynamic_shapes=dynamic_shapes())  # one package for every length
    path = os.path.join(out_dir, f"block_{device}.pt2")
    torch._inductor.aoti_compile_and_package(exported, package_path=path)
    print(f"export_model: wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--aoti", choices=["cpu", "cuda"], help="write the AOTInductor package for this device instead")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.aoti:
        export_aoti(a.out, a.aoti)
    else:
        export_reference(a.out)
        export_decode(a.out)


if __name__ == "__main__":
    main()
