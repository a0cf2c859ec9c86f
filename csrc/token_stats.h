// Raw-pointer kernels of the fused vocab-parallel token-statistics op (see megatron_rlvr/ops/records.py).
//
// Forward: for each of T token rows of a logits shard [T, V_local] (row stride V_local), write one float64 record
// [m, s, a, zy, top-N values, top-N global ids] of the temperature-scaled logits z over the valid columns
// [0, n_valid). Backward: write dL/dlogits into grad_out (which may alias logits) from the merged statistics.
// No torch here: the binding (binding.cpp) checks tensors and passes pointers.
#pragma once

#include <cstdint>

namespace token_stats {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat64 = 2 };

struct ForwardArgs {
  const void* logits;  // [T, V_local] of `dtype`
  DType dtype;
  int64_t num_tokens;
  int64_t vocab_local;
  const int64_t* target_ids;  // [T] global ids
  double* records;            // [T, 4 + 2 * top_n]
  int64_t top_n;
  int64_t vocab_start;
  int64_t n_valid;  // columns [n_valid, V_local) are vocabulary padding
  double inv_temperature;
};

// Small per-token tensors are `acc` typed: float for fp32/bf16 logits, double for fp64 logits.
struct BackwardArgs {
  const void* logits;  // [T, V_local] of `dtype`
  void* grad_out;      // [T, V_local] of `dtype`; may equal logits (in-place backward)
  DType dtype;
  int64_t num_tokens;
  int64_t vocab_local;
  const int64_t* target_ids;  // [T] global ids
  const int64_t* topn_ids;    // [T, top_n] global ids
  int64_t top_n;
  const void* logz;          // [T]
  const void* entropy;       // [T]
  const void* grad_logp;     // [T]
  const void* grad_entropy;  // [T]
  const void* grad_topn;     // [T, top_n]
  int64_t vocab_start;
  int64_t n_valid;
  double inv_temperature;
};

void forward_cpu(const ForwardArgs& args, int num_threads);
void backward_cpu(const BackwardArgs& args, int num_threads);
// The instruction set the CPU kernels dispatched to: "avx512", "avx2" or "generic".
const char* cpu_isa();

#ifdef WITH_CUDA
constexpr int kCudaMaxTopN = 32;
// The scalar kernels (token_stats_cuda.cu): one block per row, one element per load, the top-N merged in N rounds of
// block-wide argmax; the first to pass on a GPU.
void forward_cuda(const ForwardArgs& args, void* stream);
void backward_cuda(const BackwardArgs& args, void* stream);
// The vector kernels (token_stats_cuda_vector.cu): 128-bit loads and stores, the top-N merged in registers; fp64
// rows go to the scalar kernels.
void forward_cuda_vector(const ForwardArgs& args, void* stream);
void backward_cuda_vector(const BackwardArgs& args, void* stream);
#endif

}  // namespace token_stats
