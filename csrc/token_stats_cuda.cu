// CUDA kernels of the token-statistics op: one thread block per token row. Forward: each thread streams its
// strided columns with an online max / sum-exp / sum-exp*z and a register top-N (bf16 or fp32 loads, fp32 math),
// then warp shuffles and shared memory merge the block's states and N rounds of block-wide argmax merge the
// top-N lists (ties -> lower id). Backward: one pass over the row, in place when grad_out aliases the logits.
// fp64 rows (gradcheck) use the same code with double math.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "token_stats.h"

namespace token_stats {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename E>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
__device__ __forceinline__ float acc_exp(float v) { return __expf(v); }
__device__ __forceinline__ double acc_exp(double v) { return exp(v); }

template <typename Acc>
__device__ __forceinline__ Acc neg_inf() {
  return -static_cast<Acc>(INFINITY);
}

// The online-softmax state of a set of columns: max m, s = sum exp(z - m), a = sum exp(z - m) (z - m).
template <typename Acc>
struct Softmax {
  Acc m, s, a;
};

template <typename Acc>
__device__ __forceinline__ Softmax<Acc> combine(Softmax<Acc> x, Softmax<Acc> y) {
  const Acc m = x.m > y.m ? x.m : y.m;
  if (m == neg_inf<Acc>()) return {m, Acc(0), Acc(0)};
  Softmax<Acc> out{m, Acc(0), Acc(0)};
  if (x.s > Acc(0)) {
    const Acc shift = x.m - m, w = acc_exp(shift);
    out.s += w * x.s;
    out.a += w * (x.a + shift * x.s);
  }
  if (y.s > Acc(0)) {
    const Acc shift = y.m - m, w = acc_exp(shift);
    out.s += w * y.s;
    out.a += w * (y.a + shift * y.s);
  }
  return out;
}

template <typename Acc>
__device__ __forceinline__ Softmax<Acc> shuffle_xor(Softmax<Acc> v, int lane_mask) {
  return {__shfl_xor_sync(kFullMask, v.m, lane_mask), __shfl_xor_sync(kFullMask, v.s, lane_mask),
          __shfl_xor_sync(kFullMask, v.a, lane_mask)};
}

// (value, local id) candidates: higher value first, lower id on ties; INT_MAX marks an empty slot.
template <typename Acc>
__device__ __forceinline__ bool better(Acc v1, int i1, Acc v2, int i2) {
  return v1 > v2 || (v1 == v2 && i1 < i2);
}

template <typename E, int MAXN>
__global__ void __launch_bounds__(kThreads) forward_kernel(const E* __restrict__ logits, int64_t vocab_local,
                                                           const int64_t* __restrict__ target_ids,
                                                           double* __restrict__ records, int top_n,
                                                           int64_t vocab_start, int n_valid, double inv_temperature) {
  using Acc = typename AccOf<E>::type;
  const int64_t row = blockIdx.x;
  const E* x = logits + row * vocab_local;
  const Acc inv_t = static_cast<Acc>(inv_temperature);

  Softmax<Acc> state{neg_inf<Acc>(), Acc(0), Acc(0)};
  Acc top_v[MAXN];
  int top_i[MAXN];
  int count = 0;
  Acc last = neg_inf<Acc>();  // top_v[top_n - 1], kept apart: a run-time index would move the list to local memory
#pragma unroll
  for (int k = 0; k < MAXN; ++k) {
    top_v[k] = neg_inf<Acc>();
    top_i[k] = INT_MAX;
  }
#pragma unroll 4
  for (int j = threadIdx.x; j < n_valid; j += kThreads) {
    const Acc z = to_acc(x[j]) * inv_t;
    if (z > state.m) {  // online rescaling to the new max
      if (state.m != neg_inf<Acc>()) {
        const Acc shift = state.m - z, w = acc_exp(shift);
        state.a = w * (state.a + shift * state.s);
        state.s = w * state.s;
      }
      state.m = z;
    }
    if (state.m != neg_inf<Acc>()) {
      const Acc t = z - state.m, e = acc_exp(t);
      state.s += e;
      if (e > Acc(0)) state.a += e * t;
    }
    // A thread sees its ids in increasing order: an equal value never displaces a kept one (ties -> lower id).
    if (top_n > 0 && (count < top_n || z > last)) {
      Acc v = z;
      int id = j;
      bool shifting = false;
#pragma unroll
      for (int k = 0; k < MAXN; ++k) {
        if (k < top_n && (shifting || k >= count || v > top_v[k])) {
          const Acc tv = top_v[k];
          const int ti = top_i[k];
          top_v[k] = v;
          top_i[k] = id;
          v = tv;
          id = ti;
          shifting = true;
        }
        if (k == top_n - 1) last = top_v[k];
      }
      count = count < top_n ? count + 1 : top_n;
    }
  }

  __shared__ Softmax<Acc> warp_state[kWarps];
  __shared__ Acc warp_v[kWarps];
  __shared__ int warp_i[kWarps];
  __shared__ Acc winner_v;
  __shared__ int winner_i;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  for (int offset = 16; offset > 0; offset /= 2) state = combine(state, shuffle_xor(state, offset));
  if (lane == 0) warp_state[warp] = state;
  __syncthreads();
  double* record = records + row * (4 + 2 * static_cast<int64_t>(top_n));
  if (threadIdx.x == 0) {
    Softmax<Acc> total = warp_state[0];
    for (int w = 1; w < kWarps; ++w) total = combine(total, warp_state[w]);
    record[0] = total.m;
    record[1] = total.s;
    record[2] = total.a;
    const int64_t sampled = target_ids[row] - vocab_start;
    record[3] = (sampled >= 0 && sampled < n_valid) ? static_cast<double>(to_acc(x[sampled]) * inv_t)
                                                    : -static_cast<double>(INFINITY);
  }

  // N rounds of block-wide argmax over the heads of the per-thread lists; the winner pops its head.
  for (int n = 0; n < top_n; ++n) {
    Acc v = top_v[0];
    int id = top_i[0];
    for (int offset = 16; offset > 0; offset /= 2) {
      const Acc ov = __shfl_xor_sync(kFullMask, v, offset);
      const int oi = __shfl_xor_sync(kFullMask, id, offset);
      if (better(ov, oi, v, id)) {
        v = ov;
        id = oi;
      }
    }
    if (lane == 0) {
      warp_v[warp] = v;
      warp_i[warp] = id;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      Acc bv = warp_v[0];
      int bi = warp_i[0];
      for (int w = 1; w < kWarps; ++w) {
        if (better(warp_v[w], warp_i[w], bv, bi)) {
          bv = warp_v[w];
          bi = warp_i[w];
        }
      }
      winner_v = bv;
      winner_i = bi;
      const bool real = bi != INT_MAX;
      record[4 + n] = real ? static_cast<double>(bv) : -static_cast<double>(INFINITY);
      record[4 + top_n + n] = real ? static_cast<double>(vocab_start + bi) : static_cast<double>(INFINITY);
    }
    __syncthreads();
    if (top_i[0] == winner_i && winner_i != INT_MAX) {
#pragma unroll
      for (int k = 0; k + 1 < MAXN; ++k) {
        top_v[k] = top_v[k + 1];
        top_i[k] = top_i[k + 1];
      }
      top_v[MAXN - 1] = neg_inf<Acc>();
      top_i[MAXN - 1] = INT_MAX;
    }
    __syncthreads();  // warp_v / winner are rewritten next round
  }
}

template <typename Acc>
__device__ __forceinline__ Acc dense_grad(Acc z, Acc logz, Acc entropy, Acc total, Acc g_h, Acc inv_t) {
  const Acc lp = z - logz, p = acc_exp(lp);
  return p > Acc(0) ? (-total * p - g_h * p * (lp + entropy)) * inv_t : Acc(0);
}

template <typename E>
__global__ void __launch_bounds__(kThreads) backward_kernel(
    const E* logits, E* grad_out, int64_t vocab_local, const int64_t* __restrict__ target_ids,
    const int64_t* __restrict__ topn_ids, int top_n, const typename AccOf<E>::type* __restrict__ logz,
    const typename AccOf<E>::type* __restrict__ entropy, const typename AccOf<E>::type* __restrict__ grad_logp,
    const typename AccOf<E>::type* __restrict__ grad_entropy, const typename AccOf<E>::type* __restrict__ grad_topn,
    int64_t vocab_start, int n_valid, double inv_temperature) {
  using Acc = typename AccOf<E>::type;
  constexpr int kMaxSpecials = kCudaMaxTopN + 1;
  __shared__ int special_col[kMaxSpecials];
  __shared__ Acc special_w[kMaxSpecials];
  __shared__ Acc special_z[kMaxSpecials];
  const int64_t row = blockIdx.x;
  const E* x = logits + row * vocab_local;
  E* out = grad_out + row * vocab_local;
  const Acc inv_t = static_cast<Acc>(inv_temperature);

  // The sampled and top-N columns this shard owns: their logits are read before the dense pass overwrites them.
  const int specials = top_n + 1;
  if (threadIdx.x < specials) {
    const int k = threadIdx.x;
    const int64_t global = k == 0 ? target_ids[row] : topn_ids[row * top_n + k - 1];
    const int64_t local = global - vocab_start;
    const bool owned = local >= 0 && local < n_valid;
    special_col[k] = owned ? static_cast<int>(local) : -1;
    special_w[k] = k == 0 ? grad_logp[row] : grad_topn[row * top_n + k - 1];
    special_z[k] = owned ? to_acc(x[local]) * inv_t : Acc(0);
  }
  Acc total = grad_logp[row];
  for (int n = 0; n < top_n; ++n) total += grad_topn[row * top_n + n];
  const Acc lz = logz[row], h = entropy[row], g_h = grad_entropy[row];
  __syncthreads();

#pragma unroll 4
  for (int j = threadIdx.x; j < n_valid; j += kThreads) {
    store(out + j, dense_grad(to_acc(x[j]) * inv_t, lz, h, total, g_h, inv_t));
  }
  for (int64_t j = n_valid + threadIdx.x; j < vocab_local; j += kThreads) store(out + j, Acc(0));
  __syncthreads();

  if (threadIdx.x < specials && special_col[threadIdx.x] >= 0) {
    const int k = threadIdx.x, col = special_col[k];
    bool first = true;
    Acc weight = 0;
    for (int j = 0; j < specials; ++j) {
      if (special_col[j] == col) {
        weight += special_w[j];
        first = first && j >= k;
      }
    }
    // a column that is both the sampled id and a top-N id is written once, with both one-hot shares
    if (first) store(out + col, dense_grad(special_z[k], lz, h, total, g_h, inv_t) + weight * inv_t);
  }
}

template <typename E>
void launch_forward(const ForwardArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.num_tokens));
  const E* logits = static_cast<const E*>(args.logits);
  const int top_n = static_cast<int>(args.top_n), n_valid = static_cast<int>(args.n_valid);
#define TS_LAUNCH_FORWARD(MAXN)                                                                          \
  forward_kernel<E, MAXN><<<grid, kThreads, 0, stream>>>(logits, args.vocab_local, args.target_ids,      \
                                                         args.records, top_n, args.vocab_start, n_valid, \
                                                         args.inv_temperature)
  if (top_n <= 4) {
    TS_LAUNCH_FORWARD(4);
  } else if (top_n <= 8) {
    TS_LAUNCH_FORWARD(8);
  } else if (top_n <= 16) {
    TS_LAUNCH_FORWARD(16);
  } else {
    TS_LAUNCH_FORWARD(32);
  }
#undef TS_LAUNCH_FORWARD
}

template <typename E>
void launch_backward(const BackwardArgs& args, cudaStream_t stream) {
  using Acc = typename AccOf<E>::type;
  backward_kernel<E><<<static_cast<unsigned>(args.num_tokens), kThreads, 0, stream>>>(
      static_cast<const E*>(args.logits), static_cast<E*>(args.grad_out), args.vocab_local, args.target_ids,
      args.topn_ids, static_cast<int>(args.top_n), static_cast<const Acc*>(args.logz),
      static_cast<const Acc*>(args.entropy), static_cast<const Acc*>(args.grad_logp),
      static_cast<const Acc*>(args.grad_entropy), static_cast<const Acc*>(args.grad_topn), args.vocab_start,
      static_cast<int>(args.n_valid), args.inv_temperature);
}

}  // namespace

void forward_cuda(const ForwardArgs& args, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (args.dtype) {
    case DType::kFloat32:
      return launch_forward<float>(args, s);
    case DType::kBFloat16:
      return launch_forward<__nv_bfloat16>(args, s);
    case DType::kFloat64:
      return launch_forward<double>(args, s);
  }
}

void backward_cuda(const BackwardArgs& args, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (args.dtype) {
    case DType::kFloat32:
      return launch_backward<float>(args, s);
    case DType::kBFloat16:
      return launch_backward<__nv_bfloat16>(args, s);
    case DType::kFloat64:
      return launch_backward<double>(args, s);
  }
}

}  // namespace token_stats
