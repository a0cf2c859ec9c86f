// The per-thread state of the vector CUDA kernel (token_stats_cuda_vector.cu), and how two states merge: an online
// softmax (max, sum of exp, sum of exp * shifted logit) and a sorted top-N list of (value, local id) in registers.
// Plain host/device code with no CUDA intrinsics, so a CPU test (tests/ops/test_cuda_row_state.py) compiles this
// same file with g++ and drives the kernel's merge order (per-thread strided columns, the warp's xor butterfly, the
// block's merge) against a sorted reference.
#pragma once

#include <climits>
#include <cmath>

#if defined(__CUDACC__)
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline
#endif

namespace token_stats {
namespace row_state {

constexpr int kEmptyId = INT_MAX;  // an unused top-N slot; sorts after every real id

TS_HD float exp_approx(float v) {
#if defined(__CUDA_ARCH__)
  return __expf(v);  // ex2.approx: about 2 ulp, what the scalar kernel uses too (--use_fast_math)
#else
  return std::exp(v);
#endif
}

TS_HD float max_of(float a, float b) { return fmaxf(a, b); }  // a NaN operand yields the other one

// Higher value first; on equal values the lower id (the op's contract: ties to the lower id).
TS_HD bool better(float v1, int i1, float v2, int i2) { return v1 > v2 || (v1 == v2 && i1 < i2); }

// The online-softmax state of a set of columns: m = max z, s = sum exp(z - m), a = sum exp(z - m) (z - m).
struct Softmax {
  float m, s, a;
};

TS_HD Softmax empty_softmax() { return {-INFINITY, 0.f, 0.f}; }

TS_HD Softmax combine(Softmax x, Softmax y) {
  const float m = x.m > y.m ? x.m : y.m;
  if (m == -INFINITY) return {m, 0.f, 0.f};
  Softmax out{m, 0.f, 0.f};
  if (x.s > 0.f) {
    const float shift = x.m - m, w = exp_approx(shift);
    out.s += w * x.s;
    out.a += w * (x.a + shift * x.s);
  }
  if (y.s > 0.f) {
    const float shift = y.m - m, w = exp_approx(shift);
    out.s += w * y.s;
    out.a += w * (y.a + shift * y.s);
  }
  return out;
}

// Adds W columns (temperature-scaled logits z) to the state: one rescale per vector, not one per element. Returns
// the vector's max, which gates the top-N insertion.
template <int W>
TS_HD float absorb(Softmax& st, const float (&z)[W]) {
  float vmax = z[0];
#pragma unroll
  for (int k = 1; k < W; ++k) vmax = max_of(vmax, z[k]);
  if (vmax > st.m) {
    if (st.m == -INFINITY) {  // nothing but -inf columns so far: s and a hold no mass
      st.s = 0.f;
      st.a = 0.f;
    } else {
      const float shift = st.m - vmax, w = exp_approx(shift);
      st.a = w * (st.a + shift * st.s);
      st.s = w * st.s;
    }
    st.m = vmax;
  }
#pragma unroll
  for (int k = 0; k < W; ++k) {
    // -FLT_MAX floors both z = -inf (t = -inf would make 0 * -inf) and -inf - -inf (NaN; max_of drops it)
    const float t = max_of(z[k] - st.m, -3.402823466e38f);
    const float e = exp_approx(t);
    st.s += e;
    st.a = fmaf(e, t, st.a);
  }
  return vmax;
}

// The N best (value, local id) candidates seen, sorted best first; slots not filled hold (-inf, kEmptyId).
template <int N>
struct TopN {
  float v[N];
  int i[N];

  TS_HD void clear() {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = -INFINITY;
      i[k] = kEmptyId;
    }
  }

  // One candidate: replaces the last slot if better, then bubbles up. Indices are compile-time after unrolling, so
  // the list stays in registers.
  TS_HD void insert(float value, int id) {
    if (!better(value, id, v[N - 1], i[N - 1])) return;
    v[N - 1] = value;
    i[N - 1] = id;
#pragma unroll
    for (int k = N - 1; k > 0; --k) {
      if (better(v[k], i[k], v[k - 1], i[k - 1])) {
        const float tv = v[k];
        const int ti = i[k];
        v[k] = v[k - 1];
        i[k] = i[k - 1];
        v[k - 1] = tv;
        i[k - 1] = ti;
      }
    }
  }

  // W consecutive columns starting at local id `first`, whose max is `vmax`. A thread sees its ids in increasing
  // order, so an equal value never displaces a kept real id; `>=` only lets the exact test in `insert` run.
  template <int W>
  TS_HD void offer(const float (&z)[W], float vmax, int first) {
    if (vmax >= v[N - 1]) {
#pragma unroll
      for (int k = 0; k < W; ++k) insert(z[k], first + k);
    }
  }

  // The top N of this list and another sorted list (ov, oi): pairing slot k with the other's slot N-1-k and keeping
  // the better one leaves the top N as a bitonic sequence, which a bitonic merge network sorts (N a power of two).
  TS_HD void merge(const float (&ov)[N], const int (&oi)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (!better(v[k], i[k], ov[N - 1 - k], oi[N - 1 - k])) {
        v[k] = ov[N - 1 - k];
        i[k] = oi[N - 1 - k];
      }
    }
#pragma unroll
    for (int span = N / 2; span > 0; span /= 2) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if ((k & span) == 0 && better(v[k + span], i[k + span], v[k], i[k])) {
          const float tv = v[k];
          const int ti = i[k];
          v[k] = v[k + span];
          i[k] = i[k + span];
          v[k + span] = tv;
          i[k + span] = ti;
        }
      }
    }
  }
};

// N = 0 (no top-N asked): nothing to keep.
template <>
struct TopN<0> {
  TS_HD void clear() {}
  template <int W>
  TS_HD void offer(const float (&)[W], float, int) {}
};

// The list size a top_n runs with: a power of two (the merge network's need), and few sizes (each is a kernel).
constexpr int list_size(int top_n) { return top_n == 0 ? 0 : top_n <= 4 ? 4 : top_n <= 8 ? 8 : top_n <= 16 ? 16 : 32; }

}  // namespace row_state
}  // namespace token_stats
