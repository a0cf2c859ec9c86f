// CPU kernels of the token-statistics op: OpenMP over token rows; each row is one streaming pass (forward) or one
// pass (backward). The fp32/bf16 row code (token_stats_cpu_rows.inc) is compiled for AVX-512, AVX2 and the x86-64
// baseline and chosen once at run time from the CPU's features, so the extension runs on any x86-64 machine and
// still uses the widest vectors it has (MEGATRON_RLVR_CPU_ISA=generic|avx2|avx512 forces one, for benchmarks).
// fp64 rows (gradcheck only) use plain scalar code.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "token_stats.h"

namespace token_stats {
namespace {

#define TS_LANES 4
namespace isa_generic {
#include "token_stats_cpu_rows.inc"
}
#undef TS_LANES

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TS_HAVE_X86_VARIANTS 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define TS_LANES 8
namespace isa_avx2 {
#include "token_stats_cpu_rows.inc"
}
#undef TS_LANES
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif
#define TS_LANES 16
namespace isa_avx512 {
#include "token_stats_cpu_rows.inc"
}
#undef TS_LANES
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa detect_isa() {
  const char* forced = std::getenv("MEGATRON_RLVR_CPU_ISA");
  const std::string want = forced ? forced : "";
#ifdef TS_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (want == "generic") return Isa::kGeneric;
  if (want == "avx2") return avx2 ? Isa::kAvx2 : Isa::kGeneric;
  if (avx512) return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

Isa isa() {
  static const Isa chosen = detect_isa();
  return chosen;
}

template <typename E>
void forward_row(const E* x, int64_t n_valid, float inv_t, int64_t sampled_local, int64_t top_n,
                 int64_t vocab_start, float* top_v, int64_t* top_i, double* record) {
  switch (isa()) {
#ifdef TS_HAVE_X86_VARIANTS
    case Isa::kAvx512:
      return isa_avx512::forward_row(x, n_valid, inv_t, sampled_local, top_n, vocab_start, top_v, top_i, record);
    case Isa::kAvx2:
      return isa_avx2::forward_row(x, n_valid, inv_t, sampled_local, top_n, vocab_start, top_v, top_i, record);
#endif
    default:
      return isa_generic::forward_row(x, n_valid, inv_t, sampled_local, top_n, vocab_start, top_v, top_i, record);
  }
}

template <typename E>
void backward_row(const E* x, E* out, int64_t n_valid, int64_t vocab_local, float inv_t, float logz, float entropy,
                  float total, float g_h, int64_t num_specials, const int64_t* col, const float* weight,
                  float* special_z) {
  switch (isa()) {
#ifdef TS_HAVE_X86_VARIANTS
    case Isa::kAvx512:
      return isa_avx512::backward_row(x, out, n_valid, vocab_local, inv_t, logz, entropy, total, g_h, num_specials,
                                      col, weight, special_z);
    case Isa::kAvx2:
      return isa_avx2::backward_row(x, out, n_valid, vocab_local, inv_t, logz, entropy, total, g_h, num_specials,
                                    col, weight, special_z);
#endif
    default:
      return isa_generic::backward_row(x, out, n_valid, vocab_local, inv_t, logz, entropy, total, g_h,
                                       num_specials, col, weight, special_z);
  }
}

// fp64 rows: two plain passes (max, then sums and top-N); only gradcheck uses fp64.
void forward_row_f64(const double* x, int64_t n_valid, double inv_t, int64_t sampled_local, int64_t top_n,
                     int64_t vocab_start, double* top_v, int64_t* top_i, double* record) {
  double m = -INFINITY;
  for (int64_t j = 0; j < n_valid; ++j) m = std::max(m, x[j] * inv_t);
  double s = 0.0, a = 0.0;
  int64_t count = 0;
  for (int64_t j = 0; j < n_valid; ++j) {
    const double z = x[j] * inv_t;
    if (m != -INFINITY) {
      const double e = std::exp(z - m);
      s += e;
      if (e > 0) a += e * (z - m);
    }
    if (top_n == 0 || (count == top_n && !(z > top_v[top_n - 1]))) continue;
    int64_t k = count < top_n ? count++ : top_n - 1;
    while (k > 0 && z > top_v[k - 1]) {
      top_v[k] = top_v[k - 1];
      top_i[k] = top_i[k - 1];
      --k;
    }
    top_v[k] = z;
    top_i[k] = j;
  }
  record[0] = m;
  record[1] = s;
  record[2] = a;
  record[3] = (sampled_local >= 0 && sampled_local < n_valid) ? x[sampled_local] * inv_t : -INFINITY;
  for (int64_t k = 0; k < top_n; ++k) {
    record[4 + k] = k < count ? top_v[k] : -INFINITY;
    record[4 + top_n + k] = k < count ? static_cast<double>(vocab_start + top_i[k]) : INFINITY;
  }
}

void backward_row_f64(const double* x, double* out, int64_t n_valid, int64_t vocab_local, double inv_t,
                      double logz, double entropy, double total, double g_h, int64_t num_specials, const int64_t* col,
                      const double* weight) {
  std::vector<double> special_z(num_specials);
  for (int64_t k = 0; k < num_specials; ++k) special_z[k] = x[col[k]] * inv_t;
  auto dense = [&](double z) {
    const double lp = z - logz, p = std::exp(lp);
    return p > 0 ? (-total * p - g_h * p * (lp + entropy)) * inv_t : 0.0;
  };
  for (int64_t j = 0; j < n_valid; ++j) out[j] = dense(x[j] * inv_t);
  for (int64_t j = n_valid; j < vocab_local; ++j) out[j] = 0.0;
  for (int64_t k = 0; k < num_specials; ++k) out[col[k]] = dense(special_z[k]);
  for (int64_t k = 0; k < num_specials; ++k) out[col[k]] += weight[k] * inv_t;
}

// The columns of this row's sampled and top-N ids that this shard owns, with their incoming gradients.
template <typename Acc>
int64_t collect_specials(const BackwardArgs& args, int64_t t, int64_t* col, Acc* weight) {
  const Acc* g_logp = static_cast<const Acc*>(args.grad_logp);
  const Acc* g_topn = static_cast<const Acc*>(args.grad_topn);
  int64_t count = 0;
  auto add = [&](int64_t global_id, Acc w) {
    const int64_t local = global_id - args.vocab_start;
    if (local >= 0 && local < args.n_valid) {
      col[count] = local;
      weight[count++] = w;
    }
  };
  add(args.target_ids[t], g_logp[t]);
  for (int64_t n = 0; n < args.top_n; ++n) add(args.topn_ids[t * args.top_n + n], g_topn[t * args.top_n + n]);
  return count;
}

template <typename E>
void forward_rows(const ForwardArgs& args, int num_threads) {
  const E* logits = static_cast<const E*>(args.logits);
  const int64_t width = 4 + 2 * args.top_n;
  const float inv_t = static_cast<float>(args.inv_temperature);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> top_v(args.top_n);
    std::vector<int64_t> top_i(args.top_n);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < args.num_tokens; ++t) {
      forward_row(logits + t * args.vocab_local, args.n_valid, inv_t, args.target_ids[t] - args.vocab_start,
                  args.top_n, args.vocab_start, top_v.data(), top_i.data(), args.records + t * width);
    }
  }
}

void forward_rows_f64(const ForwardArgs& args, int num_threads) {
  const double* logits = static_cast<const double*>(args.logits);
  const int64_t width = 4 + 2 * args.top_n;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<double> top_v(args.top_n);
    std::vector<int64_t> top_i(args.top_n);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < args.num_tokens; ++t) {
      forward_row_f64(logits + t * args.vocab_local, args.n_valid, args.inv_temperature,
                      args.target_ids[t] - args.vocab_start, args.top_n, args.vocab_start, top_v.data(),
                      top_i.data(), args.records + t * width);
    }
  }
}

template <typename E>
void backward_rows(const BackwardArgs& args, int num_threads) {
  const E* logits = static_cast<const E*>(args.logits);
  E* grad = static_cast<E*>(args.grad_out);
  const float* logz = static_cast<const float*>(args.logz);
  const float* entropy = static_cast<const float*>(args.entropy);
  const float* g_logp = static_cast<const float*>(args.grad_logp);
  const float* g_h = static_cast<const float*>(args.grad_entropy);
  const float* g_topn = static_cast<const float*>(args.grad_topn);
  const float inv_t = static_cast<float>(args.inv_temperature);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<int64_t> col(args.top_n + 1);
    std::vector<float> weight(args.top_n + 1), special_z(args.top_n + 1);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < args.num_tokens; ++t) {
      float total = g_logp[t];
      for (int64_t n = 0; n < args.top_n; ++n) total += g_topn[t * args.top_n + n];
      const int64_t specials = collect_specials<float>(args, t, col.data(), weight.data());
      backward_row(logits + t * args.vocab_local, grad + t * args.vocab_local, args.n_valid, args.vocab_local,
                   inv_t, logz[t], entropy[t], total, g_h[t], specials, col.data(), weight.data(),
                   special_z.data());
    }
  }
}

void backward_rows_f64(const BackwardArgs& args, int num_threads) {
  const double* logits = static_cast<const double*>(args.logits);
  double* grad = static_cast<double*>(args.grad_out);
  const double* logz = static_cast<const double*>(args.logz);
  const double* entropy = static_cast<const double*>(args.entropy);
  const double* g_logp = static_cast<const double*>(args.grad_logp);
  const double* g_h = static_cast<const double*>(args.grad_entropy);
  const double* g_topn = static_cast<const double*>(args.grad_topn);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<int64_t> col(args.top_n + 1);
    std::vector<double> weight(args.top_n + 1);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < args.num_tokens; ++t) {
      double total = g_logp[t];
      for (int64_t n = 0; n < args.top_n; ++n) total += g_topn[t * args.top_n + n];
      const int64_t specials = collect_specials<double>(args, t, col.data(), weight.data());
      backward_row_f64(logits + t * args.vocab_local, grad + t * args.vocab_local, args.n_valid, args.vocab_local,
                       args.inv_temperature, logz[t], entropy[t], total, g_h[t], specials, col.data(),
                       weight.data());
    }
  }
}

}  // namespace

void forward_cpu(const ForwardArgs& args, int num_threads) {
  switch (args.dtype) {
    case DType::kFloat32:
      return forward_rows<float>(args, num_threads);
    case DType::kBFloat16:
      return forward_rows<uint16_t>(args, num_threads);
    case DType::kFloat64:
      return forward_rows_f64(args, num_threads);
  }
}

void backward_cpu(const BackwardArgs& args, int num_threads) {
  switch (args.dtype) {
    case DType::kFloat32:
      return backward_rows<float>(args, num_threads);
    case DType::kBFloat16:
      return backward_rows<uint16_t>(args, num_threads);
    case DType::kFloat64:
      return backward_rows_f64(args, num_threads);
  }
}

const char* cpu_isa() {
  switch (isa()) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

}  // namespace token_stats
