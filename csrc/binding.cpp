// pybind11 binding of the token-statistics kernels: checks tensors (device, dtype, shape, contiguity) with errors
// that name the argument, then passes raw pointers to the CPU or CUDA kernel. The Python side
// (megatron_rlvr/ops/backends.py) is the only caller.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <string>

#include "token_stats.h"

namespace {

using token_stats::DType;

DType logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kDouble:
      return DType::kFloat64;
    default:
      TORCH_CHECK(false, "logits: expected float32, bfloat16 or float64, got ", logits.scalar_type());
  }
}

void check(const at::Tensor& t, const char* name, const at::Tensor& logits, at::ScalarType dtype,
           std::vector<int64_t> shape) {
  TORCH_CHECK(t.device() == logits.device(), name, ": expected device ", logits.device(), ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), name, ": expected shape ", at::IntArrayRef(shape), ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_layout(const at::Tensor& logits, int64_t top_n, int64_t vocab_start, int64_t n_valid) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits: expected a contiguous [T, V_local] tensor");
  TORCH_CHECK(top_n >= 0, "top_n: expected >= 0, got ", top_n);
  TORCH_CHECK(vocab_start >= 0, "vocab_start: expected >= 0, got ", vocab_start);
  TORCH_CHECK(n_valid >= 0 && n_valid <= logits.size(1), "n_valid: expected in [0, ", logits.size(1), "], got ",
              n_valid);
}

// "scalar" or "vector": which of the two CUDA kernels (token_stats.h) runs CUDA tensors; checked on every device.
bool vector_kernel(const std::string& cuda_kernel) {
  TORCH_CHECK(cuda_kernel == "scalar" || cuda_kernel == "vector", "cuda_kernel: expected 'scalar' or 'vector', got '",
              cuda_kernel, "'");
  return cuda_kernel == "vector";
}

void token_stats_forward(const at::Tensor& logits, const at::Tensor& target_ids, const at::Tensor& records,
                         int64_t top_n, int64_t vocab_start, int64_t n_valid, double inv_temperature,
                         const std::string& cuda_kernel) {
  const bool vector = vector_kernel(cuda_kernel);
  check_layout(logits, top_n, vocab_start, n_valid);
  const int64_t num_tokens = logits.size(0);
  check(target_ids, "target_ids", logits, at::kLong, {num_tokens});
  check(records, "records", logits, at::kDouble, {num_tokens, 4 + 2 * top_n});
  token_stats::ForwardArgs args{logits.data_ptr(), logits_dtype(logits), num_tokens, logits.size(1),
                                target_ids.data_ptr<int64_t>(), records.data_ptr<double>(), top_n, vocab_start,
                                n_valid, inv_temperature};
  if (num_tokens == 0) return;
  if (logits.is_cuda()) {
#ifdef WITH_CUDA
    TORCH_CHECK(top_n <= token_stats::kCudaMaxTopN, "top_n: the CUDA kernel supports up to ",
                token_stats::kCudaMaxTopN, ", got ", top_n);
    const c10::cuda::CUDAGuard guard(logits.device());
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    if (vector) {
      token_stats::forward_cuda_vector(args, stream);
    } else {
      token_stats::forward_cuda(args, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
#else
    TORCH_CHECK(false, "megatron_rlvr._C was built without CUDA");
#endif
  }
  (void)vector;  // CPU tensors run the CPU kernel
  TORCH_CHECK(logits.is_cpu(), "logits: expected a CPU or CUDA tensor, got ", logits.device());
  token_stats::forward_cpu(args, at::get_num_threads());
}

void token_stats_backward(const at::Tensor& logits, const at::Tensor& grad_out, const at::Tensor& target_ids,
                          const at::Tensor& topn_ids, const at::Tensor& logz, const at::Tensor& entropy,
                          const at::Tensor& grad_logp, const at::Tensor& grad_entropy, const at::Tensor& grad_topn,
                          int64_t vocab_start, int64_t n_valid, double inv_temperature,
                          const std::string& cuda_kernel) {
  const bool vector = vector_kernel(cuda_kernel);
  const int64_t top_n = topn_ids.dim() == 2 ? topn_ids.size(1) : -1;
  check_layout(logits, top_n, vocab_start, n_valid);
  const int64_t num_tokens = logits.size(0);
  const at::ScalarType acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  check(grad_out, "grad_out", logits, logits.scalar_type(), {num_tokens, logits.size(1)});
  check(target_ids, "target_ids", logits, at::kLong, {num_tokens});
  check(topn_ids, "topn_ids", logits, at::kLong, {num_tokens, top_n});
  check(logz, "logz", logits, acc, {num_tokens});
  check(entropy, "entropy", logits, acc, {num_tokens});
  check(grad_logp, "grad_logp", logits, acc, {num_tokens});
  check(grad_entropy, "grad_entropy", logits, acc, {num_tokens});
  check(grad_topn, "grad_topn", logits, acc, {num_tokens, top_n});
  token_stats::BackwardArgs args{logits.data_ptr(), grad_out.data_ptr(), logits_dtype(logits), num_tokens,
                                 logits.size(1), target_ids.data_ptr<int64_t>(), topn_ids.data_ptr<int64_t>(),
                                 top_n, logz.data_ptr(), entropy.data_ptr(), grad_logp.data_ptr(),
                                 grad_entropy.data_ptr(), grad_topn.data_ptr(), vocab_start, n_valid,
                                 inv_temperature};
  if (num_tokens == 0) return;
  if (logits.is_cuda()) {
#ifdef WITH_CUDA
    const c10::cuda::CUDAGuard guard(logits.device());
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    if (vector) {
      token_stats::backward_cuda_vector(args, stream);
    } else {
      token_stats::backward_cuda(args, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
#else
    TORCH_CHECK(false, "megatron_rlvr._C was built without CUDA");
#endif
  }
  (void)vector;  // CPU tensors run the CPU kernel
  TORCH_CHECK(logits.is_cpu(), "logits: expected a CPU or CUDA tensor, got ", logits.device());
  token_stats::backward_cpu(args, at::get_num_threads());
}

bool has_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-rlvr fused kernels (token statistics over vocab-sharded logits)";
  m.def("token_stats_forward", &token_stats_forward, "Fill the per-token records of one logits shard",
        py::arg("logits"), py::arg("target_ids"), py::arg("records"), py::arg("top_n"), py::arg("vocab_start"),
        py::arg("n_valid"), py::arg("inv_temperature"), py::arg("cuda_kernel") = "scalar");
  m.def("token_stats_backward", &token_stats_backward, "Write dL/dlogits of one shard (grad_out may be logits)",
        py::arg("logits"), py::arg("grad_out"), py::arg("target_ids"), py::arg("topn_ids"), py::arg("logz"),
        py::arg("entropy"), py::arg("grad_logp"), py::arg("grad_entropy"), py::arg("grad_topn"),
        py::arg("vocab_start"), py::arg("n_valid"), py::arg("inv_temperature"), py::arg("cuda_kernel") = "scalar");
  m.def("has_cuda", &has_cuda, "Whether the CUDA kernels were compiled in");
  m.def("cpu_isa", &token_stats::cpu_isa, "The instruction set the CPU kernels use: avx512, avx2 or generic");
}
