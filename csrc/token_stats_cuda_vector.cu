// The vector CUDA kernels of the token-statistics op, written to run at the bound of reading the logits once. One
// thread block per token row. Forward: each thread streams a strided slice of the row in 128-bit loads (4 fp32 or 8
// bf16 values, several loads in flight), keeps an online (max, sum exp, sum exp * z) with one rescale per vector and
// a sorted top-N in registers (token_stats_cuda_row.cuh), then a warp's xor-shuffle butterfly and one merge of the
// warps' states through shared memory give the row's record. Backward: one pass that reads the row and writes its
// gradient in the same vector width, in place when grad_out aliases the logits.
//
// The same contract as the scalar kernels (token_stats_cuda.cu) and the CPU ones: records of
// megatron_rlvr/ops/records.py, ties to the lower id, padded columns never read and given a zero gradient, fp32
// math for bf16 input. A row's start need not be 16-byte aligned: its first columns up to the alignment go one per
// thread, as do the last ones after the whole vectors. fp32 and bf16 only; fp64 (gradcheck) runs the scalar kernels.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "token_stats.h"
#include "token_stats_cuda_row.cuh"

namespace token_stats {
namespace {

using row_state::Softmax;
using row_state::TopN;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLoadsInFlight = 4;  // 128-bit loads a thread issues before it uses the first (64 bytes in flight)
constexpr unsigned kFullMask = 0xffffffffu;

// W elements of E as the unit a thread loads or stores: 16 bytes (W = 4 fp32, 8 bf16), or one element (W = 1) when
// the gradient buffer's alignment differs from the logits'.
template <typename E, int W>
struct Pack;

template <>
struct Pack<float, 4> {
  using Raw = float4;
  __device__ static void unpack(Raw r, float scale, float (&z)[4]) {
    z[0] = r.x * scale;
    z[1] = r.y * scale;
    z[2] = r.z * scale;
    z[3] = r.w * scale;
  }
  __device__ static Raw pack(const float (&g)[4]) { return make_float4(g[0], g[1], g[2], g[3]); }
};

template <>
struct Pack<__nv_bfloat16, 8> {
  using Raw = uint4;
  // bf16 is the top half of an fp32: element 2k sits in the low 16 bits of word k (little-endian)
  __device__ static void unpack_word(unsigned w, float scale, float& lo, float& hi) {
    lo = __uint_as_float(w << 16) * scale;
    hi = __uint_as_float(w & 0xffff0000u) * scale;
  }
  __device__ static void unpack(Raw r, float scale, float (&z)[8]) {
    unpack_word(r.x, scale, z[0], z[1]);
    unpack_word(r.y, scale, z[2], z[3]);
    unpack_word(r.z, scale, z[4], z[5]);
    unpack_word(r.w, scale, z[6], z[7]);
  }
  __device__ static unsigned pack_word(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x (lo) at the lower address
    return *reinterpret_cast<const unsigned*>(&h);
  }
  __device__ static Raw pack(const float (&g)[8]) {
    return make_uint4(pack_word(g[0], g[1]), pack_word(g[2], g[3]), pack_word(g[4], g[5]), pack_word(g[6], g[7]));
  }
};

template <>
struct Pack<float, 1> {
  using Raw = float;
  __device__ static void unpack(Raw r, float scale, float (&z)[1]) { z[0] = r * scale; }
  __device__ static Raw pack(const float (&g)[1]) { return g[0]; }
};

template <>
struct Pack<__nv_bfloat16, 1> {
  using Raw = __nv_bfloat16;
  __device__ static void unpack(Raw r, float scale, float (&z)[1]) { z[0] = __bfloat162float(r) * scale; }
  __device__ static Raw pack(const float (&g)[1]) { return __float2bfloat16_rn(g[0]); }
};

template <typename E>
constexpr int kVectorWidth = 16 / static_cast<int>(sizeof(E));

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store_value(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_value(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Elements before the first 16-byte boundary of a row that starts at `p` (E-aligned, as every tensor is).
template <typename E>
__device__ __forceinline__ int misaligned_head(const E* p) {
  const unsigned offset = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u);
  return offset == 0 ? 0 : static_cast<int>((16u - offset) / sizeof(E));
}

__device__ __forceinline__ Softmax shuffle_xor(Softmax v, int lane_mask) {
  return {__shfl_xor_sync(kFullMask, v.m, lane_mask), __shfl_xor_sync(kFullMask, v.s, lane_mask),
          __shfl_xor_sync(kFullMask, v.a, lane_mask)};
}

// One step of the xor butterfly: merge this lane's state with lane ^ lane_mask's (every lane of the warp takes part).
template <int N>
__device__ __forceinline__ void merge_with_lane(Softmax& st, TopN<N>& top, int lane_mask) {
  st = row_state::combine(st, shuffle_xor(st, lane_mask));
  if constexpr (N > 0) {
    float ov[N];
    int oi[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      ov[k] = __shfl_xor_sync(kFullMask, top.v[k], lane_mask);
      oi[k] = __shfl_xor_sync(kFullMask, top.i[k], lane_mask);
    }
    top.merge(ov, oi);
  }
}

template <typename E, int N>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const E* __restrict__ logits, int64_t vocab_local, const int64_t* __restrict__ target_ids,
                   double* __restrict__ records, int top_n, int64_t vocab_start, int n_valid, float inv_t) {
  constexpr int W = kVectorWidth<E>;
  using P = Pack<E, W>;
  const int64_t row = blockIdx.x;
  const E* x = logits + row * vocab_local;
  const int tid = threadIdx.x;
  const int head = min(misaligned_head(x), n_valid);
  const int vectors = (n_valid - head) / W;
  const int tail = head + vectors * W;

  Softmax st = row_state::empty_softmax();
  TopN<N> top;
  top.clear();
  // Column order within a thread is increasing (head, then its vectors, then the tail): ties keep the lower id.
  if (tid < head) {
    const float z[1] = {to_float(x[tid]) * inv_t};
    top.offer(z, row_state::absorb(st, z), tid);
  }
  const typename P::Raw* vx = reinterpret_cast<const typename P::Raw*>(x + head);
  int v = tid;
  for (; v + (kLoadsInFlight - 1) * kThreads < vectors; v += kLoadsInFlight * kThreads) {
    typename P::Raw raw[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) raw[u] = __ldcs(vx + v + u * kThreads);  // streamed: read once
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      float z[W];
      P::unpack(raw[u], inv_t, z);
      top.offer(z, row_state::absorb(st, z), head + (v + u * kThreads) * W);
    }
  }
  for (; v < vectors; v += kThreads) {
    float z[W];
    P::unpack(__ldcs(vx + v), inv_t, z);
    top.offer(z, row_state::absorb(st, z), head + v * W);
  }
  if (tail + tid < n_valid) {  // fewer than W columns: one per thread
    const float z[1] = {to_float(x[tail + tid]) * inv_t};
    top.offer(z, row_state::absorb(st, z), tail + tid);
  }

  // The warp's states into lane 0 (every lane, in fact), then the warps' into warp 0 through shared memory.
  const int lane = tid % 32, warp = tid / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) merge_with_lane(st, top, offset);
  constexpr int kSlots = N > 0 ? N : 1;
  __shared__ Softmax warp_state[kWarps];
  __shared__ float warp_v[kWarps][kSlots];
  __shared__ int warp_i[kWarps][kSlots];
  if (lane == 0) {
    warp_state[warp] = st;
    if constexpr (N > 0) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        warp_v[warp][k] = top.v[k];
        warp_i[warp][k] = top.i[k];
      }
    }
  }
  __syncthreads();
  if (warp != 0) return;
  st = lane < kWarps ? warp_state[lane] : row_state::empty_softmax();
  if constexpr (N > 0) {
    if (lane < kWarps) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        top.v[k] = warp_v[lane][k];
        top.i[k] = warp_i[lane][k];
      }
    } else {
      top.clear();
    }
  }
#pragma unroll
  for (int offset = kWarps / 2; offset > 0; offset /= 2) merge_with_lane(st, top, offset);
  if (lane != 0) return;
  double* record = records + row * (4 + 2 * static_cast<int64_t>(top_n));
  record[0] = st.m;
  record[1] = st.s;
  record[2] = st.a;
  const int64_t sampled = target_ids[row] - vocab_start;
  record[3] = (sampled >= 0 && sampled < n_valid) ? static_cast<double>(to_float(x[sampled]) * inv_t)
                                                  : -static_cast<double>(INFINITY);
  if constexpr (N > 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k < top_n) {
        const bool real = top.i[k] != row_state::kEmptyId;
        record[4 + k] = real ? static_cast<double>(top.v[k]) : -static_cast<double>(INFINITY);
        record[4 + top_n + k] = real ? static_cast<double>(vocab_start + top.i[k]) : static_cast<double>(INFINITY);
      }
    }
  }
}

// dL/dz_j = p_j (c0 + c1 log p_j) off the one-hot columns, with c0 = -(total + g_H H) / T and c1 = -g_H / T
// already divided by the temperature (the gradient is w.r.t. the raw logits).
__device__ __forceinline__ float dense_grad(float z, float logz, float c0, float c1) {
  const float lp = z - logz, p = row_state::exp_approx(lp);
  return p > 0.f ? p * fmaf(c1, lp, c0) : 0.f;  // p = 0 (lp = -inf) would give 0 * inf
}

template <typename E, int W>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const E* logits, E* grad_out, int64_t vocab_local, const int64_t* __restrict__ target_ids,
                    const int64_t* __restrict__ topn_ids, int top_n, const float* __restrict__ logz,
                    const float* __restrict__ entropy, const float* __restrict__ grad_logp,
                    const float* __restrict__ grad_entropy, const float* __restrict__ grad_topn, int64_t vocab_start,
                    int n_valid, float inv_t) {
  using P = Pack<E, W>;
  constexpr int kMaxSpecials = kCudaMaxTopN + 1;
  __shared__ int special_col[kMaxSpecials];
  __shared__ float special_w[kMaxSpecials];
  __shared__ float special_z[kMaxSpecials];
  const int64_t row = blockIdx.x;
  const E* x = logits + row * vocab_local;  // may alias out: each column is read before it is written
  E* out = grad_out + row * vocab_local;
  const int tid = threadIdx.x;

  // The sampled and top-N columns this shard owns: their logits are read before the dense pass overwrites them.
  const int specials = top_n + 1;
  if (tid < specials) {
    const int64_t global = tid == 0 ? target_ids[row] : topn_ids[row * top_n + tid - 1];
    const int64_t local = global - vocab_start;
    const bool owned = local >= 0 && local < n_valid;
    special_col[tid] = owned ? static_cast<int>(local) : -1;
    special_w[tid] = tid == 0 ? grad_logp[row] : grad_topn[row * top_n + tid - 1];
    special_z[tid] = owned ? to_float(x[local]) * inv_t : 0.f;
  }
  float total = grad_logp[row];
  for (int n = 0; n < top_n; ++n) total += grad_topn[row * top_n + n];
  const float lz = logz[row], g_h = grad_entropy[row];
  const float c0 = -(total + g_h * entropy[row]) * inv_t, c1 = -g_h * inv_t;
  __syncthreads();

  const int head = W == 1 ? 0 : min(misaligned_head(x), n_valid);  // W > 1: out has the same alignment
  const int vectors = (n_valid - head) / W;
  const int tail = head + vectors * W;
  if (tid < head) store_value(out + tid, dense_grad(to_float(x[tid]) * inv_t, lz, c0, c1));
  const typename P::Raw* vx = reinterpret_cast<const typename P::Raw*>(x + head);
  typename P::Raw* vout = reinterpret_cast<typename P::Raw*>(out + head);
  int v = tid;
  for (; v + (kLoadsInFlight - 1) * kThreads < vectors; v += kLoadsInFlight * kThreads) {
    typename P::Raw raw[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) raw[u] = __ldcs(vx + v + u * kThreads);
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      float z[W];
      P::unpack(raw[u], inv_t, z);
#pragma unroll
      for (int k = 0; k < W; ++k) z[k] = dense_grad(z[k], lz, c0, c1);
      __stcs(vout + v + u * kThreads, P::pack(z));
    }
  }
  for (; v < vectors; v += kThreads) {
    float z[W];
    P::unpack(__ldcs(vx + v), inv_t, z);
#pragma unroll
    for (int k = 0; k < W; ++k) z[k] = dense_grad(z[k], lz, c0, c1);
    __stcs(vout + v, P::pack(z));
  }
  if (tail + tid < n_valid) store_value(out + tail + tid, dense_grad(to_float(x[tail + tid]) * inv_t, lz, c0, c1));
  for (int64_t j = n_valid + tid; j < vocab_local; j += kThreads) store_value(out + j, 0.f);
  __syncthreads();

  if (tid < specials && special_col[tid] >= 0) {
    const int col = special_col[tid];
    bool first = true;
    float weight = 0.f;
    for (int j = 0; j < specials; ++j) {
      if (special_col[j] == col) {
        weight += special_w[j];
        first = first && j >= tid;
      }
    }
    // a column that is both the sampled id and a top-N id is written once, with both one-hot shares
    if (first) store_value(out + col, dense_grad(special_z[tid], lz, c0, c1) + weight * inv_t);
  }
}

template <typename E, int N>
void launch_forward_n(const ForwardArgs& args, cudaStream_t stream) {
  forward_kernel<E, N><<<static_cast<unsigned>(args.num_tokens), kThreads, 0, stream>>>(
      static_cast<const E*>(args.logits), args.vocab_local, args.target_ids, args.records,
      static_cast<int>(args.top_n), args.vocab_start, static_cast<int>(args.n_valid),
      static_cast<float>(args.inv_temperature));
}

template <typename E>
void launch_forward(const ForwardArgs& args, cudaStream_t stream) {
  switch (row_state::list_size(static_cast<int>(args.top_n))) {
    case 0:
      return launch_forward_n<E, 0>(args, stream);
    case 4:
      return launch_forward_n<E, 4>(args, stream);
    case 8:
      return launch_forward_n<E, 8>(args, stream);
    case 16:
      return launch_forward_n<E, 16>(args, stream);
    default:
      return launch_forward_n<E, 32>(args, stream);
  }
}

template <typename E, int W>
void launch_backward_w(const BackwardArgs& args, cudaStream_t stream) {
  backward_kernel<E, W><<<static_cast<unsigned>(args.num_tokens), kThreads, 0, stream>>>(
      static_cast<const E*>(args.logits), static_cast<E*>(args.grad_out), args.vocab_local, args.target_ids,
      args.topn_ids, static_cast<int>(args.top_n), static_cast<const float*>(args.logz),
      static_cast<const float*>(args.entropy), static_cast<const float*>(args.grad_logp),
      static_cast<const float*>(args.grad_entropy), static_cast<const float*>(args.grad_topn), args.vocab_start,
      static_cast<int>(args.n_valid), static_cast<float>(args.inv_temperature));
}

template <typename E>
void launch_backward(const BackwardArgs& args, cudaStream_t stream) {
  // one vector width for both buffers: when their offsets from a 16-byte boundary differ, one element at a time
  const auto gap = reinterpret_cast<uintptr_t>(args.logits) - reinterpret_cast<uintptr_t>(args.grad_out);
  if (gap % 16 == 0) return launch_backward_w<E, kVectorWidth<E>>(args, stream);
  return launch_backward_w<E, 1>(args, stream);
}

}  // namespace

void forward_cuda_vector(const ForwardArgs& args, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (args.dtype) {
    case DType::kFloat32:
      return launch_forward<float>(args, s);
    case DType::kBFloat16:
      return launch_forward<__nv_bfloat16>(args, s);
    case DType::kFloat64:
      return forward_cuda(args, stream);  // gradcheck's dtype: the scalar kernel's double math
  }
}

void backward_cuda_vector(const BackwardArgs& args, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (args.dtype) {
    case DType::kFloat32:
      return launch_backward<float>(args, s);
    case DType::kBFloat16:
      return launch_backward<__nv_bfloat16>(args, s);
    case DType::kFloat64:
      return backward_cuda(args, stream);
  }
}

}  // namespace token_stats
