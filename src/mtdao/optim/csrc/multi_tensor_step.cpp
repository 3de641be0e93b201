// The MT-DAO update rules (Adam, ADOPT, SGD with momenta) as one multi-tensor CPU kernel.
//
// One call walks every tensor set of a bucket: the work is cut into chunks of at most
// kChunkNumel elements (a small tensor is one chunk) and the chunks are shared among torch's
// intra-op threads. Each element is read and written once. The math is element-wise with no
// reduction, so the result does not depend on the thread count or on how work is split.
//
// Each element is updated by one loop body that reads every tensor once and writes it once; for
// N <= 4 momenta N is a compile-time constant, so the loop over momenta unrolls and the element
// loop vectorizes (-O3). The operations and their order are those of the element updates in
// mtdao/optim/fused.py (built with -ffp-contract=off: no fused multiply-adds), each correctly
// rounded, so the result agrees with those functions run eagerly to the last bit or one rounding
// (torch's vectorized sqrt is not always correctly rounded). Coefficient layouts are there.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kChunkNumel = 1 << 16;
// Below this many elements in all the update runs on the calling thread (torch's own element-wise
// kernels start a second thread at the same size).
constexpr int64_t kParallelMinNumel = 1 << 15;

enum class Rule { kAdam, kAdopt, kSgd };

// The pointers of one tensor set, the state pointers typed as the computation type S.
template <typename P, typename S>
struct TensorSet {
  P* x;
  const P* g;
  std::vector<S*> momenta;
  S* v;  // nullptr for SGD
  int64_t numel;
};

struct Chunk {
  int64_t set;
  int64_t begin;
  int64_t end;
};

// The momenta pointers of a set for a loop over [begin, end). N > 0: exactly N momenta, known to
// the compiler (the loop over them unrolls and the element loop vectorizes); N == 0: any number.
template <int N, typename S>
struct Momenta {
  static constexpr int kCapacity = N > 0 ? N : 1;
  S* u[kCapacity];
  std::vector<S*> dynamic;
  int64_t count;

  Momenta(const std::vector<S*>& momenta) : count(static_cast<int64_t>(momenta.size())) {
    if (N > 0) {
      for (int j = 0; j < N; ++j) u[j] = momenta[j];
    } else {
      dynamic = momenta;
    }
  }
  inline int64_t size() const { return N > 0 ? N : count; }
  inline S* operator[](int64_t j) const { return N > 0 ? u[j] : dynamic[j]; }
};

// x' = x c0; u_j' = u_j + c_j (g - u_j); v' = v b2 + ((1 - b2) g) g;
// x'' = x' + (c_w0 g + sum_j s_j u_j') / (sqrt(v') c_bc + eps)
template <int N, typename P, typename S>
void adam_range(const TensorSet<P, S>& t, int64_t begin, int64_t end, const std::vector<S>& c) {
  const Momenta<N, S> u(t.momenta);
  const int64_t k = u.size();
  const S decay = c[0], b2 = c[k + 1], one_minus_b2 = c[k + 2], bias = c[k + 3], eps = c[k + 4];
  const S grad_weight = c[k + 5];
  const S* rate = c.data() + 1;
  const S* size = c.data() + k + 6;
  const P* __restrict__ g = t.g;
  P* __restrict__ x = t.x;
  S* __restrict__ v = t.v;
#pragma GCC ivdep
  for (int64_t i = begin; i < end; ++i) {
    const S gi = static_cast<S>(g[i]);
    const S new_x = static_cast<S>(x[i]) * decay;
    const S vi = v[i] * b2 + one_minus_b2 * gi * gi;
    v[i] = vi;
    const S denom = std::sqrt(vi) * bias + eps;
    S step = grad_weight * gi;
    for (int64_t j = 0; j < k; ++j) {
      const S uj = u[j][i] + rate[j] * (gi - u[j][i]);
      u[j][i] = uj;
      step = step + size[j] * uj;
    }
    x[i] = static_cast<P>(new_x + step / denom);
  }
}

// Clamping as torch's clamp_min/clamp do it: a NaN stays NaN.
template <typename S>
inline S clamp_below(S value, S low) {
  return value < low ? low : value;
}

template <typename S>
inline S clamp_above(S value, S high) {
  return value > high ? high : value;
}

// n = clamp(g / max(sqrt(v), eps), -clip, clip); u_j' = u_j + c_j (n - u_j);
// x' = x c0 + c_w0 n + sum_j c'_j u_j'; then v' = v b2 + ((1 - b2) g) g
template <int N, typename P, typename S>
void adopt_range(const TensorSet<P, S>& t, int64_t begin, int64_t end, const std::vector<S>& c) {
  const Momenta<N, S> u(t.momenta);
  const int64_t k = u.size();
  const S decay = c[0], eps = c[k + 1], clip = c[k + 2], grad_weight = c[k + 3];
  const S b2 = c[2 * k + 4], one_minus_b2 = c[2 * k + 5];
  const S* rate = c.data() + 1;
  const S* size = c.data() + k + 4;
  const P* __restrict__ g = t.g;
  P* __restrict__ x = t.x;
  S* __restrict__ v = t.v;
#pragma GCC ivdep
  for (int64_t i = begin; i < end; ++i) {
    const S gi = static_cast<S>(g[i]);
    const S vi = v[i];
    S normed = gi / clamp_below(static_cast<S>(std::sqrt(vi)), eps);
    normed = clamp_above(clamp_below(normed, -clip), clip);
    S new_x = static_cast<S>(x[i]) * decay + grad_weight * normed;
    for (int64_t j = 0; j < k; ++j) {
      const S uj = u[j][i] + rate[j] * (normed - u[j][i]);
      u[j][i] = uj;
      new_x = new_x + size[j] * uj;
    }
    x[i] = static_cast<P>(new_x);
    v[i] = vi * b2 + one_minus_b2 * gi * gi;
  }
}

// u_j' = u_j + c_j (g - u_j); x' = x c0 + c_w0 g + sum_j c'_j u_j'
template <int N, typename P, typename S>
void sgd_range(const TensorSet<P, S>& t, int64_t begin, int64_t end, const std::vector<S>& c) {
  const Momenta<N, S> u(t.momenta);
  const int64_t k = u.size();
  const S decay = c[0], grad_weight = c[k + 1];
  const S* rate = c.data() + 1;
  const S* size = c.data() + k + 2;
  const P* __restrict__ g = t.g;
  P* __restrict__ x = t.x;
#pragma GCC ivdep
  for (int64_t i = begin; i < end; ++i) {
    const S gi = static_cast<S>(g[i]);
    S new_x = static_cast<S>(x[i]) * decay + grad_weight * gi;
    for (int64_t j = 0; j < k; ++j) {
      const S uj = u[j][i] + rate[j] * (gi - u[j][i]);
      u[j][i] = uj;
      new_x = new_x + size[j] * uj;
    }
    x[i] = static_cast<P>(new_x);
  }
}

template <int N, typename P, typename S>
void update_range(Rule rule, const TensorSet<P, S>& t, int64_t begin, int64_t end,
                  const std::vector<S>& c) {
  switch (rule) {
    case Rule::kAdam:
      adam_range<N>(t, begin, end, c);
      break;
    case Rule::kAdopt:
      adopt_range<N>(t, begin, end, c);
      break;
    case Rule::kSgd:
      sgd_range<N>(t, begin, end, c);
      break;
  }
}

// The update for N momenta, vectorized for the common N and general (slower) for the rest.
template <typename P, typename S>
void update_range(Rule rule, const TensorSet<P, S>& t, int64_t begin, int64_t end,
                  const std::vector<S>& c) {
  switch (t.momenta.size()) {
    case 1:
      return update_range<1>(rule, t, begin, end, c);
    case 2:
      return update_range<2>(rule, t, begin, end, c);
    case 3:
      return update_range<3>(rule, t, begin, end, c);
    case 4:
      return update_range<4>(rule, t, begin, end, c);
    default:
      return update_range<0>(rule, t, begin, end, c);
  }
}

void check_set(const at::Tensor& t, const at::Tensor& x, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "mtdao fused step: ", what, " is not on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, "mtdao fused step: ", what, " has dtype ",
              t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.is_contiguous(), "mtdao fused step: ", what, " is not contiguous");
  TORCH_CHECK(t.numel() == x.numel(), "mtdao fused step: ", what, " has ", t.numel(),
              " elements, its parameter ", x.numel());
}

template <typename P, typename S>
void run(Rule rule, at::TensorList xs, at::TensorList gs, at::TensorList momenta,
         at::TensorList vs, const std::vector<double>& coefficients) {
  const int64_t count = static_cast<int64_t>(xs.size());
  const int64_t num_momenta = static_cast<int64_t>(momenta.size()) / count;
  const at::ScalarType param_type = xs[0].scalar_type();
  const at::ScalarType state_type = momenta[0].scalar_type();
  std::vector<TensorSet<P, S>> sets(count);
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor& x = xs[i];
    check_set(x, x, param_type, "a parameter");
    check_set(gs[i], x, param_type, "a gradient");
    TensorSet<P, S>& set = sets[i];
    set.x = static_cast<P*>(x.data_ptr());
    set.g = static_cast<const P*>(gs[i].data_ptr());
    for (int64_t j = 0; j < num_momenta; ++j) {
      const at::Tensor& u = momenta[j * count + i];
      check_set(u, x, state_type, "a momentum");
      set.momenta.push_back(static_cast<S*>(u.data_ptr()));
    }
    set.v = nullptr;
    if (rule != Rule::kSgd) {
      check_set(vs[i], x, state_type, "a second moment");
      set.v = static_cast<S*>(vs[i].data_ptr());
    }
    set.numel = x.numel();
    for (int64_t begin = 0; begin < set.numel; begin += kChunkNumel) {
      chunks.push_back({i, begin, std::min(set.numel, begin + kChunkNumel)});
    }
    total += set.numel;
  }
  std::vector<S> c(coefficients.begin(), coefficients.end());
  auto work = [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Chunk& chunk = chunks[k];
      update_range(rule, sets[chunk.set], chunk.begin, chunk.end, c);
    }
  };
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  if (total < kParallelMinNumel) {
    work(0, num_chunks);
  } else {
    at::parallel_for(0, num_chunks, 1, work);
  }
}

void step(Rule rule, at::TensorList xs, at::TensorList gs, at::TensorList momenta,
          at::TensorList vs, const at::Tensor& coefficients, int64_t num_coefficients) {
  const int64_t count = static_cast<int64_t>(xs.size());
  if (count == 0) {
    return;
  }
  TORCH_CHECK(static_cast<int64_t>(gs.size()) == count, "mtdao fused step: ", gs.size(),
              " gradients for ", count, " parameters");
  TORCH_CHECK(!momenta.empty() && static_cast<int64_t>(momenta.size()) % count == 0,
              "mtdao fused step: ", momenta.size(), " momenta for ", count, " parameters");
  TORCH_CHECK(rule == Rule::kSgd || static_cast<int64_t>(vs.size()) == count,
              "mtdao fused step: ", vs.size(), " second moments for ", count, " parameters");
  const at::Tensor c = coefficients.contiguous();
  TORCH_CHECK(c.device().is_cpu() && c.scalar_type() == at::kDouble && c.dim() == 1 &&
                  c.numel() == num_coefficients,
              "mtdao fused step: expected ", num_coefficients,
              " float64 coefficients on the CPU, got ", c.sizes(), " ", c.scalar_type());
  const double* data = c.data_ptr<double>();
  const std::vector<double> values(data, data + c.numel());
  const at::ScalarType param_type = xs[0].scalar_type();
  const at::ScalarType state_type = momenta[0].scalar_type();
  if (param_type == at::kFloat && state_type == at::kFloat) {
    run<float, float>(rule, xs, gs, momenta, vs, values);
  } else if (param_type == at::kDouble && state_type == at::kDouble) {
    run<double, double>(rule, xs, gs, momenta, vs, values);
  } else if (param_type == at::kBFloat16 && state_type == at::kFloat) {
    run<c10::BFloat16, float>(rule, xs, gs, momenta, vs, values);
  } else if (param_type == at::kHalf && state_type == at::kFloat) {
    run<c10::Half, float>(rule, xs, gs, momenta, vs, values);
  } else {
    TORCH_CHECK(false, "mtdao fused step: no kernel for ", param_type, " parameters with ",
                state_type, " state");
  }
}

int64_t momenta_count(at::TensorList xs, at::TensorList momenta) {
  return xs.empty() ? 0 : static_cast<int64_t>(momenta.size() / xs.size());
}

void adam_step(at::TensorList xs, at::TensorList gs, at::TensorList momenta, at::TensorList vs,
               const at::Tensor& c) {
  step(Rule::kAdam, xs, gs, momenta, vs, c, 2 * momenta_count(xs, momenta) + 6);
}

void adopt_step(at::TensorList xs, at::TensorList gs, at::TensorList momenta, at::TensorList vs,
                const at::Tensor& c) {
  step(Rule::kAdopt, xs, gs, momenta, vs, c, 2 * momenta_count(xs, momenta) + 6);
}

void sgd_step(at::TensorList xs, at::TensorList gs, at::TensorList momenta, at::TensorList vs,
              const at::Tensor& c) {
  step(Rule::kSgd, xs, gs, momenta, vs, c, 2 * momenta_count(xs, momenta) + 2);
}

}  // namespace

TORCH_LIBRARY(mtdao_optim, m) {
  m.def("adam_step(Tensor(a!)[] xs, Tensor[] gs, Tensor(b!)[] momenta, Tensor(c!)[] vs, Tensor c) -> ()");
  m.def("adopt_step(Tensor(a!)[] xs, Tensor[] gs, Tensor(b!)[] momenta, Tensor(c!)[] vs, Tensor c) -> ()");
  m.def("sgd_step(Tensor(a!)[] xs, Tensor[] gs, Tensor(b!)[] momenta, Tensor(c!)[] vs, Tensor c) -> ()");
}

TORCH_LIBRARY_IMPL(mtdao_optim, CPU, m) {
  m.impl("adam_step", &adam_step);
  m.impl("adopt_step", &adopt_step);
  m.impl("sgd_step", &sgd_step);
}
