// Training from C++: gradients through the fused ops, whose autograd is registered in C++, checked.
//
//   fused_train DEVICE DIR        DEVICE: cpu or cuda; DIR: export_model.py's --out folder
//
// 1. The TorchScript block (DIR/block.pt): forward and backward with the upstream gradient saved from Python; the
//    gradients of x and of every parameter against Python's float64 reference (block_reference.pt), and on CUDA also
//    against the same step on the CPU.
// 2. Each op called directly through the dispatcher, as C++ code without TorchScript calls it: rope_fwd,
//    linear_dual, ffn dual expert and ffn single expert. The output and the gradient of every differentiable input:
//    on the CPU against the op's formula written here in ATen float64 (an independent reference), on CUDA against
//    the CPU path in float32 and in bfloat16.
// 3. A few SGD steps on the block: the loss goes down at every step.
// Exit status as fused_infer: 0 passed, 1 a check failed, 2 error, 77 CUDA asked for and no device (skip).
#include <torch/csrc/autograd/autograd.h>

#include <functional>

#include "example_checks.h"

namespace {
using at::Tensor;
using OptT = std::optional<Tensor>;

constexpr double kTolF32 = 2e-5, kTolBF16 = 3e-2;

// ------------------------------------------------------------------------------------- the ops, via the dispatcher
// example::call_op: positional arguments, then named ones; the others take their schema defaults.

Tensor rope_fwd(const Tensor& t, const Tensor& freqs) {  // "bshd", no options
  return example::call_op("fused::rope_fwd", {t, freqs}, {{"tensor_format", "bshd"}})[0].toTensor();
}

Tensor linear_dual(const Tensor& x, const Tensor& mask, const Tensor& wv, const Tensor& wt, const OptT& bv,
                   const OptT& bt) {
  return example::call_op("fused::linear_dual", {x, mask, wv, wt, bv, bt})[0].toTensor();
}

Tensor ffn(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2, const OptT& mask, const OptT& u1,
           const OptT& u3, const OptT& u2) {
  return example::call_op("fused::ffn", {x, w1, w3, w2, mask, u1, u3, u2})[0].toTensor();
}

// ----------------------------------------------------------------------- the formulas, in ATen (docs/design.md)

Tensor rope_formula(const Tensor& t, const Tensor& freqs) {  // t [b, s, h, d], freqs [s, 1, 1, d]
  auto f = freqs.transpose(0, 1).to(t.scalar_type());       // [1, s, 1, d]
  auto halves = t.chunk(2, -1);
  return t * f.cos() + at::cat({-halves[1], halves[0]}, -1) * f.sin();
}

Tensor swiglu_formula(const Tensor& a, const Tensor& w1, const Tensor& w3, const Tensor& w2) {
  return at::linear(at::silu(at::linear(a, w1)) * at::linear(a, w3), w2);
}

// ------------------------------------------------------------------------------------------------ the op cases

// One op call: its inputs (CPU, float64 masters), which of them are differentiable (those get the run's dtype; the
// others keep theirs: the bool mask, the float32 freqs), the fused call and the formula.
struct OpCase {
  std::string name;
  std::vector<std::string> input_names;
  std::vector<Tensor> inputs;
  std::vector<bool> differentiable;
  std::function<Tensor(const std::vector<Tensor>&)> fused, formula;
};

std::vector<OpCase> op_cases() {
  const int64_t b = 2, s = 24, heads = 4, d = 16, hidden = 64, out_features = 48, inter = 96;
  auto opts = torch::dtype(torch::kFloat64);
  auto w = [&](int64_t rows, int64_t cols) { return torch::rand({rows, cols}, opts) * 0.4 - 0.2; };
  Tensor x = torch::randn({b, s, hidden}, opts);
  Tensor mask = torch::rand({b, s}) < 0.5;
  mask.view(-1).index_put_({0}, true);
  mask.view(-1).index_put_({1}, false);  // both experts always hold tokens
  Tensor freqs = torch::arange(s, torch::kFloat32).unsqueeze(1) *
                 torch::pow(10000.0, -torch::arange(0, d, 2, torch::kFloat32) / d).repeat({2}).unsqueeze(0);
  freqs = freqs.view({s, 1, 1, d});

  std::vector<OpCase> cases;
  cases.push_back({"rope_fwd", {"t", "freqs"}, {torch::randn({b, s, heads, d}, opts), freqs}, {true, false},
                   [](const std::vector<Tensor>& a) { return rope_fwd(a[0], a[1]); },
                   [](const std::vector<Tensor>& a) { return rope_formula(a[0], a[1]); }});
  cases.push_back(
      {"linear_dual",
       {"x", "mask", "weight_v", "weight_t", "bias_v", "bias_t"},
       {x, mask, w(out_features, hidden), w(out_features, hidden), w(1, out_features)[0], w(1, out_features)[0]},
       {true, false, true, true, true, true},
       [](const std::vector<Tensor>& a) { return linear_dual(a[0], a[1], a[2], a[3], a[4], a[5]); },
       [](const std::vector<Tensor>& a) {
         return at::where(a[1].unsqueeze(-1), at::linear(a[0], a[2], a[4]), at::linear(a[0], a[3], a[5]));
       }});
  cases.push_back(
      {"ffn (dual expert)",
       {"x", "mask", "w1", "w3", "w2", "u1", "u3", "u2"},
       {x, mask, w(inter, hidden), w(inter, hidden), w(hidden, inter), w(inter, hidden), w(inter, hidden),
        w(hidden, inter)},
       {true, false, true, true, true, true, true, true},
       [](const std::vector<Tensor>& a) { return ffn(a[0], a[2], a[3], a[4], a[1], a[5], a[6], a[7]); },
       [](const std::vector<Tensor>& a) {
         return at::where(a[1].unsqueeze(-1), swiglu_formula(a[0], a[2], a[3], a[4]),
                          swiglu_formula(a[0], a[5], a[6], a[7]));
       }});
  cases.push_back({"ffn (single expert)",
                   {"x", "w1", "w3", "w2"},
                   {x, w(inter, hidden), w(inter, hidden), w(hidden, inter)},
                   {true, true, true, true},
                   [](const std::vector<Tensor>& a) {
                     return ffn(a[0], a[1], a[2], a[3], std::nullopt, std::nullopt, std::nullopt, std::nullopt);
                   },
                   [](const std::vector<Tensor>& a) { return swiglu_formula(a[0], a[1], a[2], a[3]); }});
  return cases;
}

// {output, gradient of each differentiable input} of `fn` on device/dtype, for the upstream gradient `grad`.
std::vector<Tensor> forward_backward(const OpCase& c, const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                                     const torch::Device& device, torch::ScalarType dtype, const Tensor& grad) {
  std::vector<Tensor> args, leaves;
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    if (c.differentiable[i]) {
      args.push_back(c.inputs[i].to(device, dtype).requires_grad_(true));
      leaves.push_back(args.back());
    } else {
      args.push_back(c.inputs[i].to(device));
    }
  }
  Tensor out = fn(args);
  std::vector<Tensor> result = {out.detach()};
  for (auto& g : torch::autograd::grad({out}, leaves, {grad.to(device, out.scalar_type())})) result.push_back(g);
  return result;
}

void check_op(example::Checker& check, const OpCase& c, const torch::Device& device) {
  std::cout << c.name << " (called through the dispatcher):\n";
  std::vector<std::string> names = {"output"};
  for (size_t i = 0; i < c.inputs.size(); ++i)
    if (c.differentiable[i]) names.push_back("grad " + c.input_names[i]);
  const Tensor grad = torch::randn(c.formula(c.inputs).sizes(), torch::kFloat64);
  if (device.is_cpu()) {
    auto got = forward_backward(c, c.fused, device, torch::kFloat32, grad);
    auto want = forward_backward(c, c.formula, torch::kCPU, torch::kFloat64, grad);
    for (size_t i = 0; i < got.size(); ++i)
      check.close(names[i] + " float32 vs the ATen float64 formula", got[i], want[i], kTolF32);
    return;
  }
  auto want = forward_backward(c, c.fused, torch::kCPU, torch::kFloat32, grad);
  auto got = forward_backward(c, c.fused, device, torch::kFloat32, grad);
  for (size_t i = 0; i < got.size(); ++i) check.close(names[i] + " float32 vs the CPU path", got[i], want[i], kTolF32);
  got = forward_backward(c, c.fused, device, torch::kBFloat16, grad);
  for (size_t i = 0; i < got.size(); ++i)
    check.close(names[i] + " bfloat16 vs the CPU path (float32)", got[i], want[i], kTolBF16);
}

// ------------------------------------------------------------------------------------------------ the block

// One forward + backward of the scripted block; returns {grad x, grad of each parameter} in named_parameters order.
std::vector<Tensor> block_grads(torch::jit::Module& model, const std::map<std::string, Tensor>& ref,
                                const torch::Device& device) {
  model.to(device);
  Tensor x = example::get(ref, "x").to(device).requires_grad_(true);
  for (const auto& p : model.parameters()) p.mutable_grad() = Tensor();
  Tensor out = model.forward({x, example::get(ref, "mask").to(device), example::get(ref, "freqs").to(device)})
                   .toTensor();
  out.backward(example::get(ref, "grad_out").to(device, out.scalar_type()));
  std::vector<Tensor> grads = {x.grad()};
  for (const auto& p : model.parameters()) grads.push_back(p.grad());
  return grads;
}

void check_block(example::Checker& check, const torch::Device& device, const std::string& dir,
                 const std::map<std::string, Tensor>& ref) {
  std::cout << "the TorchScript block (block.pt), one training step on " << device.str() << ":\n";
  torch::jit::Module model = torch::jit::load(dir + "/block.pt");
  model.train();
  std::vector<std::string> names = {"x"};
  for (const auto& p : model.named_parameters()) {
    names.push_back(p.name);
    check.require("parameter " + p.name + " requires grad after torch::jit::load", p.value.requires_grad());
  }
  auto got = block_grads(model, ref, device);
  for (size_t i = 0; i < got.size(); ++i) {
    std::string key = "grad_" + names[i];
    std::replace(key.begin(), key.end(), '.', '_');
    bool present = got[i].defined();
    check.require("grad " + names[i] + " computed", present);
    if (present)
      check.close("grad " + names[i] + " vs Python's float64 reference", got[i], example::get(ref, key), kTolF32);
  }
  if (device.is_cuda()) {
    auto cpu = block_grads(model, ref, torch::kCPU);
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i].defined()) check.close("grad " + names[i] + " vs the CPU path", got[i], cpu[i], kTolF32);
  }
}

void check_sgd(example::Checker& check, const torch::Device& device, const std::string& dir,
               const std::map<std::string, Tensor>& ref) {
  std::cout << "SGD on the block (" << device.str() << "), loss = mean((block(x) - target)^2):\n";
  torch::jit::Module model = torch::jit::load(dir + "/block.pt", device);
  model.train();
  const Tensor x = example::get(ref, "x").to(device), mask = example::get(ref, "mask").to(device);
  const Tensor freqs = example::get(ref, "freqs").to(device);
  const Tensor target = example::get(ref, "out").to(device, torch::kFloat32) * 0.5;
  std::vector<double> losses;
  for (int step = 0; step < 5; ++step) {
    for (const auto& p : model.parameters()) p.mutable_grad() = Tensor();
    Tensor loss = (model.forward({x, mask, freqs}).toTensor() - target).square().mean();
    loss.backward();
    losses.push_back(loss.item<double>());
    torch::NoGradGuard no_grad;
    for (const auto& p : model.parameters()) p.sub_(p.grad(), 1e-2);
  }
  std::string trace;
  bool decreasing = true;
  for (size_t i = 0; i < losses.size(); ++i) {
    trace += (i ? " -> " : "") + std::to_string(losses[i]);
    if (i && !(losses[i] < losses[i - 1])) decreasing = false;
  }
  check.require("loss decreases at every step: " + trace, decreasing);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " cpu|cuda DIR   (DIR: export_model.py --out)\n";
    return example::kError;
  }
  const torch::Device device = example::device_or_skip(argv[1]);
  try {
    torch::manual_seed(0);
    example::Checker check;
    const auto ref = example::load_tensors(std::string(argv[2]) + "/block_reference.pt");
    check_block(check, device, argv[2], ref);
    for (const auto& c : op_cases()) check_op(check, c, device);
    check_sgd(check, device, argv[2], ref);
    return check.finish(std::string("fused_train (") + argv[1] + ")");
  } catch (const std::exception& e) {
    std::cerr << "fused_train: error: " << example::message(e) << "\n";
    return example::kError;
  }
}
