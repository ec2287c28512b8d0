// Inference from C++: loads the model that export_model.py saved from Python, runs it on a device and checks the
// result against the output saved from Python (a float64 reference).
//
//   fused_infer DEVICE DIR            the TorchScript model DIR/block.pt, float32 and bfloat16; then the decode step
//                                     DIR/decode_step.pt (fused::decode_attention writing its KV cache buffers; CPU
//                                     float32, CUDA bfloat16) and the op called directly through the dispatcher
//   fused_infer DEVICE DIR --aoti     the AOTInductor package DIR/block_<DEVICE>.pt2, float32, at every length
//                                     export_model.py saved (1 to 8192 tokens: one package, dynamic batch and sequence)
//
// DEVICE is cpu or cuda; DIR is export_model.py's --out folder (it also holds block_reference.pt). Linking
// libfused_ops registers torch.ops.fused.* from its static initializers (the package config links it with
// --no-as-needed), so torch::jit::load and the AOTInductor loader find the ops with nothing else to call.
// Exit status: 0 all checks passed, 1 a check failed, 2 bad usage or an error (e.g. a missing file), 77 CUDA asked
// for and no device visible (a skip for ctest, never a pass).
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/passes/inliner.h>

#include "example_checks.h"

namespace {

// Tolerances of ‖out − ref‖ / ‖ref‖ against the float64 reference: float32 is fp32 math everywhere (no TF32);
// bfloat16 rounds inputs, weights, the intermediate and the output to 8 bits of mantissa.
constexpr double kTolF32 = 2e-5, kTolBF16 = 3e-2;

int run_torchscript(const torch::Device& device, const std::string& dir,
                    const std::map<std::string, at::Tensor>& ref) {
  example::Checker check;
  torch::jit::Module model = torch::jit::load(dir + "/block.pt");
  model.eval();

  // The model must really run the fused ops (a plain-PyTorch block would pass the numeric checks too).
  auto graph = model.get_method("forward").graph()->copy();
  torch::jit::Inline(*graph);  // submodule calls (DualLinear, ...) become their ops
  const std::string ir = graph->toString();
  for (const char* op : {"fused::linear_dual", "fused::rope_fwd", "fused::ffn"})
    check.require(std::string("the scripted forward calls ") + op, ir.find(op) != std::string::npos);

  c10::InferenceMode no_autograd;
  const at::Tensor& x = example::get(ref, "x");
  const at::Tensor mask = example::get(ref, "mask").to(device);
  const at::Tensor freqs = example::get(ref, "freqs").to(device);  // stays float32, whatever the model's dtype
  model.to(device);
  at::Tensor out = model.forward({x.to(device), mask, freqs}).toTensor();
  check.require("float32 output on " + device.str(), out.device().type() == device.type());
  check.close("float32 output vs Python's float64 reference", out, example::get(ref, "out"), kTolF32);

  model.to(torch::kBFloat16);
  out = model.forward({x.to(device, torch::kBFloat16), mask, freqs}).toTensor();
  check.require("bfloat16 output dtype", out.scalar_type() == torch::kBFloat16);
  check.close("bfloat16 output vs Python's float64 reference", out, example::get(ref, "out"), kTolBF16);
  return check.finish("fused_infer (TorchScript, " + device.str() + ")");
}

// Two decode steps in a row (the second attends what the first wrote into the cache), against Python's float64
// reference: the scripted DecodeStep, then fused::decode_attention called directly through the dispatcher.
int run_decode(const torch::Device& device, const std::string& dir) {
  example::Checker check;
  const auto ref = example::load_tensors(dir + "/decode_reference.pt");
  torch::jit::Module step = torch::jit::load(dir + "/decode_step.pt");
  step.eval();
  check.require("the scripted decode step calls fused::decode_attention",
                step.get_method("forward").graph()->toString().find("fused::decode_attention") != std::string::npos);
  // The CUDA kernels are bfloat16 / float16: the step runs in bfloat16 there.
  const auto dtype = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  const double tol = device.is_cuda() ? kTolBF16 : kTolF32;
  const std::string dt = device.is_cuda() ? "bfloat16" : "float32";
  c10::InferenceMode no_autograd;
  step.to(device, dtype);
  at::Tensor kc = step.attr("k_cache").toTensor(), vc = step.attr("v_cache").toTensor();
  kc.copy_(example::get(ref, "k_cache"));
  vc.copy_(example::get(ref, "v_cache"));
  at::Tensor kc_direct = kc.clone(), vc_direct = vc.clone();
  for (int i = 0; i < 2; ++i) {
    const std::string n = std::to_string(i);
    const at::Tensor qkv = example::get(ref, "qkv" + n).to(device, dtype);
    const at::Tensor lens = example::get(ref, "lens" + n).to(device);
    at::Tensor out = step.forward({qkv, lens}).toTensor();
    check.close("decode step " + n + ": " + dt + " output vs Python's float64 reference", out,
                example::get(ref, "out" + n), tol);
    check.close("decode step " + n + ": k_cache after it", kc, example::get(ref, "k_cache" + n), tol);
    check.close("decode step " + n + ": v_cache after it", vc, example::get(ref, "v_cache" + n), tol);
    // The op itself, on its own copy of the caches: q, k_new, v_new are views of the QKV output (8 / 2 / 2 heads).
    at::Tensor direct = example::call_op("fused::decode_attention",
                                         {qkv.narrow(2, 0, 8), kc_direct, vc_direct, qkv.narrow(2, 8, 2),
                                          qkv.narrow(2, 10, 2), lens})[0].toTensor();
    check.require("decode step " + n + ": the direct call gives the scripted step's bits",
                  direct.flatten(2).equal(out) && kc_direct.equal(kc) && vc_direct.equal(vc));
  }
  return check.finish("fused_infer (decode step, TorchScript, " + device.str() + ")");
}

int run_aoti(const torch::Device& device, const std::string& dir, const std::map<std::string, at::Tensor>& ref) {
  example::Checker check;
  const std::string path = dir + "/block_" + (device.is_cuda() ? "cuda" : "cpu") + ".pt2";
  torch::inductor::AOTIModelPackageLoader loader(path);
  c10::InferenceMode no_autograd;
  // The lengths export_model.py saved (len<tokens>_x, ..._out): the one package must serve every one of them.
  std::vector<std::string> lengths;
  for (const auto& [name, t] : ref)
    if (name.rfind("len", 0) == 0 && name.size() > 7 && name.compare(name.size() - 4, 4, "_out") == 0)
      lengths.push_back(name.substr(0, name.size() - 4));
  check.require("the reference holds several lengths (" + std::to_string(lengths.size()) + ")", lengths.size() >= 2);
  for (const std::string& len : lengths) {
    const at::Tensor& x = example::get(ref, len + "_x");
    std::vector<at::Tensor> outs = loader.run({x.to(device), example::get(ref, len + "_mask").to(device),
                                               example::get(ref, len + "_freqs").to(device)});
    const std::string at = " at " + len.substr(3) + " tokens [" + std::to_string(x.size(0)) + ", " +
                           std::to_string(x.size(1)) + "]";
    check.require("the package returns one output" + at, outs.size() == 1);
    if (outs.empty()) continue;
    check.require("output on " + device.str() + at, outs[0].device().type() == device.type());
    check.close("float32 output vs Python's float64 reference" + at, outs[0], example::get(ref, len + "_out"), kTolF32);
  }
  return check.finish("fused_infer (AOTInductor " + path + ")");
}

}  // namespace

int main(int argc, char** argv) {
  const bool aoti = argc == 4 && std::string(argv[3]) == "--aoti";
  if (argc != 3 && !aoti) {
    std::cerr << "usage: " << argv[0] << " cpu|cuda DIR [--aoti]   (DIR: export_model.py --out)\n";
    return example::kError;
  }
  const torch::Device device = example::device_or_skip(argv[1]);
  const std::string dir = argv[2];
  try {
    const auto ref = example::load_tensors(dir + "/block_reference.pt");
    if (aoti) return run_aoti(device, dir, ref);
    const int block = run_torchscript(device, dir, ref);
    const int decode = run_decode(device, dir);
    return block != example::kPass ? block : decode;
  } catch (const std::exception& e) {
    std::cerr << "fused_infer: error: " << example::message(e) << "\n";
    return example::kError;
  }
}
