// What the C++ examples share: the exit-status convention, the device argument, reading the tensors that
// export_model.py saved, and the relative-error check every comparison uses.
#pragma once
#include <torch/cuda.h>
#include <torch/script.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace example {

// Exit statuses: kError for bad usage or an exception (a missing file, an op's error). kSkip is ctest's
// SKIP_RETURN_CODE: the CUDA run was asked for but there is no device, which must show as "skipped", never as a pass.
constexpr int kPass = 0, kFail = 1, kError = 2, kSkip = 77;

// "cpu" or "cuda"; exits with kSkip (saying so) when CUDA is asked for and no device is visible.
inline torch::Device device_or_skip(const std::string& name) {
  if (name == "cpu") return torch::kCPU;
  if (name != "cuda") {
    std::cerr << "unknown device '" << name << "': expected cpu or cuda\n";
    std::exit(kError);
  }
  if (!torch::cuda::is_available()) {
    std::cout << "SKIP: no CUDA device visible (torch::cuda::is_available() is false): the CUDA checks did not run\n";
    std::exit(kSkip);
  }
  return torch::kCUDA;
}

// Calls op `name` ("fused::ffn") through the dispatcher as Python would: the leading arguments by position, others
// by name, and every argument not given takes its schema default (csrc/torch_bindings.cpp). So the call keeps
// working when an op gains an argument with a default; a typed<...>() signature would have to be rewritten by hand.
// Returns the op's outputs.
inline std::vector<c10::IValue> call_op(const char* name, std::vector<c10::IValue> positional,
                                        const std::map<std::string, c10::IValue>& named = {}) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  const auto& params = op.schema().arguments();
  TORCH_CHECK(positional.size() <= params.size(), name, ": ", positional.size(), " positional arguments given, the op "
              "takes ", params.size());
  size_t used = 0;
  torch::jit::Stack stack(positional.begin(), positional.end());
  for (size_t i = positional.size(); i < params.size(); ++i) {
    const auto it = named.find(params[i].name());
    if (it != named.end()) {
      stack.push_back(it->second);
      ++used;
    } else {
      TORCH_CHECK(params[i].default_value().has_value(), name, ": argument '", params[i].name(), "' is required");
      stack.push_back(*params[i].default_value());
    }
  }
  TORCH_CHECK(used == named.size(), name, ": a named argument is not one of the op's (or was also given by position)");
  op.callBoxed(stack);
  return stack;
}

// An exception's message, without the C++ backtrace that torch's errors carry.
inline const char* message(const std::exception& e) {
  auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error ? c10_error->what_without_backtrace() : e.what();
}

// The buffers of a module saved by export_model.py (its `Tensors` container), by name.
inline std::map<std::string, at::Tensor> load_tensors(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  for (const auto& b : torch::jit::load(path).named_buffers()) out[b.name] = b.value;
  return out;
}

inline const at::Tensor& get(const std::map<std::string, at::Tensor>& m, const std::string& name) {
  auto it = m.find(name);
  TORCH_CHECK(it != m.end(), "the reference file holds no tensor '", name, "' (re-run export_model.py)");
  return it->second;
}

// Counts failed checks; prints one line per check.
struct Checker {
  int failures = 0;

  // ‖got − want‖ / ‖want‖ in float64 on the CPU, against `tol`; shapes must match.
  void close(const std::string& what, const at::Tensor& got, const at::Tensor& want, double tol) {
    bool ok = got.sizes() == want.sizes();
    double err = -1;
    if (ok) {
      auto g = got.detach().to(torch::kCPU, torch::kFloat64), w = want.detach().to(torch::kCPU, torch::kFloat64);
      err = ((g - w).norm() / w.norm()).item<double>();
      ok = std::isfinite(err) && err <= tol;
    }
    std::cout << (ok ? "  ok    " : "  FAIL  ") << what << ": rel. error " << err << " (tol " << tol << ")"
              << (got.sizes() == want.sizes() ? "" : " shape mismatch") << "\n";
    failures += !ok;
  }

  void require(const std::string& what, bool ok) {
    std::cout << (ok ? "  ok    " : "  FAIL  ") << what << "\n";
    failures += !ok;
  }

  int finish(const std::string& program) const {
    std::cout << program << (failures ? ": FAILED (" + std::to_string(failures) + " checks)" : ": all checks passed")
              << "\n";
    return failures ? kFail : kPass;
  }
};

}  // namespace example
