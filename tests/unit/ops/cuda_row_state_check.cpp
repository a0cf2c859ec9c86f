// Drives the vector CUDA kernel's per-row state (csrc/token_stats_cuda_row.cuh, the same file the kernel includes)
// on the CPU, in the kernel's order: 256 threads each take the row's misaligned head column, then their strided
// W-wide vectors, then a tail column; a warp merges its 32 states by an xor butterfly (every lane reads its partner's
// state from before the step, as shuffles do), and warp 0 merges the 8 warps' states. The row's record must match a
// sorted, double-precision reference: the same top-N ids and values (ties to the lower id), the same max, and sums
// within fp32 rounding. Prints one line per failure and a last line "ok CASES" or "FAILED K of CASES".
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "token_stats_cuda_row.cuh"

using token_stats::row_state::absorb;
using token_stats::row_state::combine;
using token_stats::row_state::empty_softmax;
using token_stats::row_state::kEmptyId;
using token_stats::row_state::Softmax;
using token_stats::row_state::TopN;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <int N>
struct Lane {
  Softmax st;
  TopN<N> top;
};

template <int N>
void butterfly(std::vector<Lane<N>>& lanes, int first, int width, int start_offset) {
  for (int offset = start_offset; offset > 0; offset /= 2) {
    const std::vector<Lane<N>> before(lanes.begin() + first, lanes.begin() + first + width);
    for (int l = 0; l < width; ++l) {
      const Lane<N>& other = before[l ^ offset];
      lanes[first + l].st = combine(before[l].st, other.st);
      lanes[first + l].top = before[l].top;
      lanes[first + l].top.merge(other.top.v, other.top.i);
    }
  }
}

struct Case {
  const char* name;
  int head;  // columns before the first vector boundary
};

int failures = 0, cases = 0;

template <int N, int W>
void check_row(const std::vector<float>& z, int head, int top_n, const char* name) {
  ++cases;
  const int n_valid = static_cast<int>(z.size());
  head = std::min(head, n_valid);
  const int vectors = (n_valid - head) / W;
  const int tail = head + vectors * W;
  std::vector<Lane<N>> lanes(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    Lane<N>& lane = lanes[t];
    lane.st = empty_softmax();
    lane.top.clear();
    if (t < head) {
      const float one[1] = {z[t]};
      lane.top.template offer<1>(one, absorb(lane.st, one), t);
    }
    for (int v = t; v < vectors; v += kThreads) {
      float w[W];
      for (int k = 0; k < W; ++k) w[k] = z[head + v * W + k];
      lane.top.template offer<W>(w, absorb(lane.st, w), head + v * W);
    }
    if (tail + t < n_valid) {
      const float one[1] = {z[tail + t]};
      lane.top.template offer<1>(one, absorb(lane.st, one), tail + t);
    }
  }
  for (int w = 0; w < kWarps; ++w) butterfly(lanes, 32 * w, 32, 16);
  std::vector<Lane<N>> block(32);
  for (int l = 0; l < 32; ++l) {
    if (l < kWarps) {
      block[l] = lanes[32 * l];
    } else {
      block[l].st = empty_softmax();
      block[l].top.clear();
    }
  }
  butterfly(block, 0, 32, kWarps / 2);
  const Lane<N>& got = block[0];

  // the reference: ids sorted by (value desc, id asc); softmax sums in double
  std::vector<int> order(n_valid);
  for (int j = 0; j < n_valid; ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
  double m = -INFINITY;
  for (float v : z) m = std::max(m, static_cast<double>(v));
  double s = 0, a = 0;
  if (m > -INFINITY) {
    for (float v : z) {
      if (v == -INFINITY) continue;
      const double e = std::exp(v - m);
      s += e;
      a += e * (v - m);
    }
  }
  bool ok = got.st.m == static_cast<float>(m);
  ok = ok && std::fabs(got.st.s - s) <= 2e-5 * std::max(s, 1.0);
  ok = ok && std::fabs(got.st.a - a) <= 2e-5 * std::max(std::fabs(a), s);
  for (int k = 0; k < top_n && k < N; ++k) {
    if (k < n_valid) {  // a -inf column fills a slot too (as in the scalar kernel), the lowest such id first
      ok = ok && got.top.i[k] == order[k] && got.top.v[k] == z[order[k]];
    } else {
      ok = ok && got.top.i[k] == kEmptyId && got.top.v[k] == -INFINITY;
    }
  }
  if (!ok) {
    ++failures;
    std::printf("FAIL %s N=%d W=%d n=%d head=%d top_n=%d: m %g/%g s %g/%g a %g/%g ids", name, N, W, n_valid, head,
                top_n, got.st.m, m, got.st.s, s, got.st.a, a);
    for (int k = 0; k < std::min(top_n, N); ++k) {
      std::printf(" %d/%d", got.top.i[k], k < n_valid ? order[k] : -1);
    }
    std::printf("\n");
  }
}

template <int N, int W>
void sweep(std::mt19937& gen) {
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_int_distribution<int> few(0, 2);
  for (int n_valid : {1, 3, 9, 255, 256, 257, 1031, 2097, 5001, 18993}) {
    for (int head = 0; head < W; head += (W > 4 ? 3 : 1)) {
      std::vector<float> z(n_valid);
      for (float& v : z) v = normal(gen);
      check_row<N, W>(z, head, N, "normal");
      check_row<N, W>(z, head, N - 1, "normal");
      for (float& v : z) v = static_cast<float>(few(gen));  // every slot has equal-valued rivals
      check_row<N, W>(z, head, N, "ties");
      for (int j = 0; j < n_valid; j += 3) z[j] = -INFINITY;  // masked columns among the rest
      check_row<N, W>(z, head, N, "some -inf");
    }
  }
  check_row<N, W>(std::vector<float>(70, -INFINITY), 1, N, "all -inf");
  check_row<N, W>(std::vector<float>(3000, 1.5f), 2, N, "constant");
}

}  // namespace

int main() {
  std::mt19937 gen(1234);
  sweep<4, 4>(gen);  // fp32 vectors
  sweep<4, 8>(gen);  // bf16 vectors
  sweep<8, 4>(gen);
  sweep<16, 8>(gen);
  sweep<32, 4>(gen);
  if (failures) {
    std::printf("FAILED %d of %d\n", failures, cases);
    return 1;
  }
  std::printf("ok %d\n", cases);
  return 0;
}
