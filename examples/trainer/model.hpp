#pragma once
// The example trainer's model: a byte-level language model, forward and backward written by hand over spans with
// OpenBLAS's cblas_sgemm (row-major, f32). Pure math: nothing here knows about ranks, shards or communication; the
// trainer gathers a unit's parameters, hands them here as named spans, and reduces the gradients written here.
//
// Units (a unit = the parameters FSDP gathers together), unit 0 first:
//   embed      x[b,t]  = embed.tokens[token[b,t]] + embed.positions[t]
//   block<i>   u[t]    = x[t] + mix ⊙ x[t-1]                     (x[-1] = 0: causal previous-token mixing)
//              y[t]    = x[t] + W2·gelu(W1·rmsnorm(u[t])·norm + b1) + b2
//   head       logits  = rmsnorm(x)·norm · W;  loss = mean over the B*T positions of cross-entropy(logits, next byte)
// Each block's mix lets position t see t-1, so L blocks see L bytes back: a small but real causal context.
//
// Layout: an activation is [B*T, width] row-major, row b*T + t. A matrix parameter [rows, cols] is row-major, used
// as x·W (x is [B*T, rows]).
//
// Loss normalization (what makes data parallel correct): head_forward returns the mean over the positions of the
// batch it was given, and head_backward differentiates exactly that mean. When each of R ranks holds B/R rows of
// the global batch, the mean over ranks of the per-rank gradients equals the gradient of the global mean loss, so
// the FSDP library must AVERAGE (not sum) gradients across ranks. With M micro-batches per step, pass
// loss_scale = 1/M to head_backward so the accumulated (+=) gradients are again the mean.
//
// Threads: OpenBLAS's pthread build spawns its own threads per call. A trainer that runs ranks as threads of one
// process should call set_blas_threads(1) first.

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "pointwise.hpp"
#include "text.hpp"

namespace trainer {

struct model_config {
  int vocab = 256;
  int context = 64;  // T at most
  int width = 64;    // d
  int hidden = 256;  // h, 4d by convention
  int blocks = 6;    // L; units = L + 2
};

struct param_spec {
  std::string name;                // "<unit>.<param>", e.g. "block3.w1"
  std::vector<std::size_t> shape;  // row-major

  std::size_t numel() const {
    std::size_t n = 1;
    for (std::size_t s : shape) n *= s;
    return n;
  }
};

//! Unit names in execution order: "embed", "block0" .. "block<L-1>", "head".
inline std::vector<std::string> unit_names(const model_config& c) {
  std::vector<std::string> names{"embed"};
  for (int i = 0; i < c.blocks; ++i) names.push_back("block" + std::to_string(i));
  names.push_back("head");
  return names;
}

//! The parameters of each unit, in the order a flat unit buffer lays them out (see slice_unit).
inline std::vector<std::vector<param_spec>> unit_specs(const model_config& c) {
  const auto d = static_cast<std::size_t>(c.width), h = static_cast<std::size_t>(c.hidden);
  const auto V = static_cast<std::size_t>(c.vocab), T = static_cast<std::size_t>(c.context);
  std::vector<std::vector<param_spec>> units;
  units.push_back({{"embed.tokens", {V, d}}, {"embed.positions", {T, d}}});
  for (int i = 0; i < c.blocks; ++i) {
    const std::string p = "block" + std::to_string(i) + ".";
    units.push_back({{p + "mix", {d}},
                     {p + "norm", {d}},
                     {p + "w1", {d, h}},
                     {p + "b1", {h}},
                     {p + "w2", {h, d}},
                     {p + "b2", {d}}});
  }
  units.push_back({{"head.norm", {d}}, {"head.w", {d, V}}});
  return units;
}

inline std::size_t unit_numel(const std::vector<param_spec>& specs) {
  std::size_t n = 0;
  for (const auto& s : specs) n += s.numel();
  return n;
}

// Parameters and gradients reach the math as spans looked up by full name ("block3.w1"). std::less<> lets a
// string_view look them up without allocating.
using param_map = std::map<std::string, std::span<const float>, std::less<>>;
using grad_map = std::map<std::string, std::span<float>, std::less<>>;

//! Names the consecutive pieces of a flat unit buffer (the specs' order), e.g. a gathered FSDP unit.
template <class T>
std::map<std::string, std::span<T>, std::less<>> slice_unit(const std::vector<param_spec>& specs,
                                                            std::span<T> flat) {
  if (flat.size() != unit_numel(specs)) throw std::invalid_argument("slice_unit: buffer size != unit numel");
  std::map<std::string, std::span<T>, std::less<>> m;
  std::size_t off = 0;
  for (const auto& s : specs) {
    m.emplace(s.name, flat.subspan(off, s.numel()));
    off += s.numel();
  }
  return m;
}

namespace detail {

template <class Map>
auto lookup(const Map& m, std::string_view name, std::size_t numel) {
  auto it = m.find(name);
  if (it == m.end()) throw std::invalid_argument("trainer: missing parameter " + std::string(name));
  if (it->second.size() != numel)
    throw std::invalid_argument("trainer: parameter " + std::string(name) + " has " +
                                std::to_string(it->second.size()) + " elements, expected " + std::to_string(numel));
  return it->second;
}

// FNV-1a: the name's share of the init key, so a parameter's values do not depend on the order of the specs.
inline std::uint64_t hash_name(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// C[M,N] = alpha * op(A)·op(B) + beta * C, all row-major and dense. op(A) is [M,K], op(B) is [K,N].
inline void gemm(bool ta, bool tb, int M, int N, int K, const float* A, const float* B, float* C, float beta,
                 float alpha = 1.0f) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A,
              ta ? M : K, B, tb ? K : N, beta, C, N);
}

constexpr float rms_eps = 1e-5f;

// out[n] = in[n] * r[n] * g, r[n] = 1/sqrt(mean(in[n]^2) + eps); stores r.
inline void rmsnorm_forward(int rows, int d, const float* in, const float* g, float* out, float* r) {
  for (int n = 0; n < rows; ++n) {
    const float* x = in + static_cast<std::size_t>(n) * d;
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += static_cast<double>(x[j]) * x[j];
    r[n] = static_cast<float>(1.0 / std::sqrt(ss / d + rms_eps));
    float* o = out + static_cast<std::size_t>(n) * d;
    for (int j = 0; j < d; ++j) o[j] = x[j] * r[n] * g[j];
  }
}

// din = r * (g⊙dout - in * r^2 * mean(g⊙dout⊙in)); dg += sum over rows of dout⊙in*r. din may alias dout.
inline void rmsnorm_backward(int rows, int d, const float* in, const float* g, const float* r, const float* dout,
                             float* din, float* dg) {
  for (int n = 0; n < rows; ++n) {
    const std::size_t o = static_cast<std::size_t>(n) * d;
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += static_cast<double>(g[j]) * dout[o + j] * in[o + j];
    const float c = static_cast<float>(dot / d) * r[n] * r[n];
    for (int j = 0; j < d; ++j) {
      dg[j] += dout[o + j] * in[o + j] * r[n];
      din[o + j] = r[n] * (g[j] * dout[o + j] - in[o + j] * c);
    }
  }
}

inline void add_column_sums(int rows, int cols, const float* m, float* acc) {
  for (int n = 0; n < rows; ++n)
    for (int j = 0; j < cols; ++j) acc[j] += m[static_cast<std::size_t>(n) * cols + j];
}

}  // namespace detail

//! Deterministic from (spec.name, seed) alone, so every rank and every world size starts from the same values:
//! "*.norm" gains 1, biases "*.b1"/"*.b2" and "*.mix" 0, everything else normal(0, 0.02) from a counter-based
//! splitmix64 stream keyed on the name's hash and the element index.
inline void init_param(const param_spec& spec, std::span<float> out, std::uint64_t seed) {
  if (out.size() != spec.numel()) throw std::invalid_argument("init_param: span size != numel of " + spec.name);
  const std::string_view n = spec.name;
  if (detail::ends_with(n, ".norm")) {
    for (float& v : out) v = 1.0f;
    return;
  }
  if (detail::ends_with(n, ".b1") || detail::ends_with(n, ".b2") || detail::ends_with(n, ".mix")) {
    for (float& v : out) v = 0.0f;
    return;
  }
  const std::uint64_t key = detail::splitmix64(detail::hash_name(n) ^ detail::splitmix64(seed));
  constexpr double two_pi = 6.283185307179586;
  for (std::size_t i = 0; i < out.size(); ++i) {
    // Box-Muller on two 53-bit uniforms drawn at counters 2i and 2i+1; u1 in (0, 1] keeps log finite.
    const double u1 = static_cast<double>((detail::splitmix64(key + 2 * i) >> 11) + 1) * 0x1.0p-53;
    const double u2 = static_cast<double>(detail::splitmix64(key + 2 * i + 1) >> 11) * 0x1.0p-53;
    out[i] = static_cast<float>(0.02 * std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2));
  }
}

inline void set_blas_threads(int n) { openblas_set_num_threads(n); }

//! The BLAS the math runs on, as the trainer prints it: OpenBLAS's kernel set (what it detected, or what
//! OPENBLAS_CORETYPE forced) and its threads. A VM that reports a generic CPU gets the slow Prescott kernels unless
//! OPENBLAS_CORETYPE says otherwise (Haswell, SkylakeX), which is why the line names both.
inline std::string blas_description() {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  return std::string("OpenBLAS, ") + openblas_get_corename() + " kernels (" +
         (forced && *forced ? "OPENBLAS_CORETYPE=" + std::string(forced) : std::string("detected")) + "), " +
         std::to_string(openblas_get_num_threads()) + " thread(s)";
}

// ---- embed ----------------------------------------------------------------------------------------------------

struct embed_cache {
  std::vector<std::uint8_t> inputs;  // [B*T]
  int B = 0, T = 0;
};

//! x [B*T, d] = embed.tokens[input] + embed.positions[t].
inline void embed_forward(const model_config& c, const param_map& p, const batch& in, std::span<float> x,
                          embed_cache& cache) {
  const int d = c.width, N = in.rows();
  if (in.T > c.context) throw std::invalid_argument("embed_forward: batch T exceeds the context length");
  if (x.size() != static_cast<std::size_t>(N) * d) throw std::invalid_argument("embed_forward: x size != B*T*d");
  const auto tok = detail::lookup(p, "embed.tokens", static_cast<std::size_t>(c.vocab) * d);
  const auto pos = detail::lookup(p, "embed.positions", static_cast<std::size_t>(c.context) * d);
  cache.B = in.B;
  cache.T = in.T;
  cache.inputs.resize(N);
  for (int b = 0; b < in.B; ++b)
    for (int t = 0; t < in.T; ++t) {
      const int n = b * in.T + t;
      const std::uint8_t id = cache.inputs[n] = in.input(b, t);
      for (int j = 0; j < d; ++j)
        x[static_cast<std::size_t>(n) * d + j] = tok[static_cast<std::size_t>(id) * d + j] + pos[t * d + j];
    }
}

//! Accumulates dx into the rows of the tokens and positions used. The input is bytes: there is no dX.
inline void embed_backward(const model_config& c, const embed_cache& cache, std::span<const float> dx,
                           const grad_map& g) {
  const int d = c.width, N = cache.B * cache.T;
  if (dx.size() != static_cast<std::size_t>(N) * d) throw std::invalid_argument("embed_backward: dx size");
  const auto dtok = detail::lookup(g, "embed.tokens", static_cast<std::size_t>(c.vocab) * d);
  const auto dpos = detail::lookup(g, "embed.positions", static_cast<std::size_t>(c.context) * d);
  for (int n = 0; n < N; ++n) {
    const int t = n % cache.T;
    const std::size_t id = cache.inputs[n];
    for (int j = 0; j < d; ++j) {
      const float v = dx[static_cast<std::size_t>(n) * d + j];
      dtok[id * d + j] += v;
      dpos[static_cast<std::size_t>(t) * d + j] += v;
    }
  }
}

// ---- block ----------------------------------------------------------------------------------------------------

struct block_cache {
  int B = 0, T = 0;
  std::vector<float> x, u, r, nrm, z, a;  // forward: input, mixed, 1/rms, normed, pre-gelu, gelu
  std::vector<float> da, dnrm;            // backward scratch, kept to reuse the allocation
};

//! y [B*T, d] from x [B*T, d] for block i. y may alias x (the cache keeps a copy of x).
inline void block_forward(const model_config& c, int i, const param_map& p, int B, int T,
                          std::span<const float> x, std::span<float> y, block_cache& cache) {
  const int d = c.width, h = c.hidden, N = B * T;
  const auto Nd = static_cast<std::size_t>(N) * d, Nh = static_cast<std::size_t>(N) * h;
  if (x.size() != Nd || y.size() != Nd) throw std::invalid_argument("block_forward: x, y sizes != B*T*d");
  const std::string pre = "block" + std::to_string(i) + ".";
  const auto mix = detail::lookup(p, pre + "mix", d), g = detail::lookup(p, pre + "norm", d);
  const auto w1 = detail::lookup(p, pre + "w1", static_cast<std::size_t>(d) * h), b1 = detail::lookup(p, pre + "b1", h);
  const auto w2 = detail::lookup(p, pre + "w2", static_cast<std::size_t>(h) * d), b2 = detail::lookup(p, pre + "b2", d);

  cache.B = B;
  cache.T = T;
  cache.x.assign(x.begin(), x.end());
  cache.u.resize(Nd);
  cache.r.resize(N);
  cache.nrm.resize(Nd);
  cache.z.resize(Nh);
  cache.a.resize(Nh);
  for (int n = 0; n < N; ++n) {
    const std::size_t o = static_cast<std::size_t>(n) * d;
    const bool first = n % T == 0;
    for (int j = 0; j < d; ++j) cache.u[o + j] = cache.x[o + j] + (first ? 0.0f : mix[j] * cache.x[o - d + j]);
  }
  detail::rmsnorm_forward(N, d, cache.u.data(), g.data(), cache.nrm.data(), cache.r.data());
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < h; ++j) cache.z[static_cast<std::size_t>(n) * h + j] = b1[j];
  detail::gemm(false, false, N, h, d, cache.nrm.data(), w1.data(), cache.z.data(), 1.0f);
  for (std::size_t k = 0; k < Nh; ++k) cache.a[k] = gelu(cache.z[k]);
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < d; ++j) {
      const std::size_t k = static_cast<std::size_t>(n) * d + j;
      y[k] = cache.x[k] + b2[j];
    }
  detail::gemm(false, false, N, d, h, cache.a.data(), w2.data(), y.data(), 1.0f);
}

//! Writes dx (=, not +=) from dy and accumulates (+=) block i's parameter gradients. dx may alias dy.
inline void block_backward(const model_config& c, int i, const param_map& p, block_cache& cache,
                           std::span<const float> dy, std::span<float> dx, const grad_map& grads) {
  const int d = c.width, h = c.hidden, B = cache.B, T = cache.T, N = B * T;
  const auto Nd = static_cast<std::size_t>(N) * d, Nh = static_cast<std::size_t>(N) * h;
  if (dy.size() != Nd || dx.size() != Nd) throw std::invalid_argument("block_backward: dy, dx sizes != B*T*d");
  const std::string pre = "block" + std::to_string(i) + ".";
  const auto mix = detail::lookup(p, pre + "mix", d), g = detail::lookup(p, pre + "norm", d);
  const auto w1 = detail::lookup(p, pre + "w1", static_cast<std::size_t>(d) * h);
  const auto w2 = detail::lookup(p, pre + "w2", static_cast<std::size_t>(h) * d);
  const auto dmix = detail::lookup(grads, pre + "mix", d), dg = detail::lookup(grads, pre + "norm", d);
  const auto dw1 = detail::lookup(grads, pre + "w1", static_cast<std::size_t>(d) * h);
  const auto db1 = detail::lookup(grads, pre + "b1", h);
  const auto dw2 = detail::lookup(grads, pre + "w2", static_cast<std::size_t>(h) * d);
  const auto db2 = detail::lookup(grads, pre + "b2", d);

  // Everything that reads dy runs before dx is written, so the two may share storage.
  cache.da.resize(Nh);
  cache.dnrm.resize(Nd);
  detail::add_column_sums(N, d, dy.data(), db2.data());
  detail::gemm(true, false, h, d, N, cache.a.data(), dy.data(), dw2.data(), 1.0f);       // dW2 += aᵀ·dy
  detail::gemm(false, true, N, h, d, dy.data(), w2.data(), cache.da.data(), 0.0f);       // da = dy·W2ᵀ
  for (std::size_t k = 0; k < Nh; ++k) cache.da[k] *= gelu_grad(cache.z[k]);             // dz
  detail::add_column_sums(N, h, cache.da.data(), db1.data());
  detail::gemm(true, false, d, h, N, cache.nrm.data(), cache.da.data(), dw1.data(), 1.0f);  // dW1 += nrmᵀ·dz
  detail::gemm(false, true, N, d, h, cache.da.data(), w1.data(), cache.dnrm.data(), 0.0f);  // dnrm = dz·W1ᵀ
  // du, in place over dnrm.
  detail::rmsnorm_backward(N, d, cache.u.data(), g.data(), cache.r.data(), cache.dnrm.data(), cache.dnrm.data(),
                           dg.data());
  const std::vector<float>& du = cache.dnrm;
  // u[t] = x[t] + mix⊙x[t-1]: x[t] gets du[t] directly and mix⊙du[t+1] through the next position.
  for (int n = 0; n < N; ++n) {
    const std::size_t o = static_cast<std::size_t>(n) * d;
    const bool last = n % T == T - 1, first = n % T == 0;
    for (int j = 0; j < d; ++j) {
      if (!first) dmix[j] += du[o + j] * cache.x[o - d + j];
      dx[o + j] = dy[o + j] + du[o + j] + (last ? 0.0f : mix[j] * du[o + d + j]);
    }
  }
}

// ---- head -----------------------------------------------------------------------------------------------------

struct head_cache {
  int B = 0, T = 0;
  std::vector<std::uint8_t> targets;  // [B*T]
  std::vector<float> x, r, nrm, probs;  // probs: softmax of the logits, [B*T, vocab]
};

//! The mean over the batch's B*T positions of the cross-entropy of the next byte (see the file comment on why the
//! mean is over this batch's own positions).
inline double head_forward(const model_config& c, const param_map& p, const batch& in, std::span<const float> x,
                           head_cache& cache) {
  const int d = c.width, V = c.vocab, N = in.rows();
  if (x.size() != static_cast<std::size_t>(N) * d) throw std::invalid_argument("head_forward: x size != B*T*d");
  const auto g = detail::lookup(p, "head.norm", d);
  const auto w = detail::lookup(p, "head.w", static_cast<std::size_t>(d) * V);
  cache.B = in.B;
  cache.T = in.T;
  cache.targets.resize(N);
  for (int b = 0; b < in.B; ++b)
    for (int t = 0; t < in.T; ++t) cache.targets[b * in.T + t] = in.target(b, t);
  cache.x.assign(x.begin(), x.end());
  cache.r.resize(N);
  cache.nrm.resize(x.size());
  cache.probs.resize(static_cast<std::size_t>(N) * V);
  detail::rmsnorm_forward(N, d, cache.x.data(), g.data(), cache.nrm.data(), cache.r.data());
  detail::gemm(false, false, N, V, d, cache.nrm.data(), w.data(), cache.probs.data(), 0.0f);
  double total = 0;
  for (int n = 0; n < N; ++n) {
    float* row = cache.probs.data() + static_cast<std::size_t>(n) * V;
    float mx = row[0];
    for (int v = 1; v < V; ++v) mx = std::max(mx, row[v]);
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    const double lse = mx + std::log(sum);
    total += lse - row[cache.targets[n]];
    for (int v = 0; v < V; ++v) row[v] = static_cast<float>(std::exp(static_cast<double>(row[v]) - lse));
  }
  return total / N;
}

//! Starts the backward pass from the loss: dx = d(loss_scale * loss)/dx (=, not +=), and accumulates (+=) the
//! head's parameter gradients. loss_scale = 1/M averages M accumulated micro-batches.
inline void head_backward(const model_config& c, const param_map& p, head_cache& cache, std::span<float> dx,
                          const grad_map& grads, float loss_scale = 1.0f) {
  const int d = c.width, V = c.vocab, N = cache.B * cache.T;
  if (dx.size() != static_cast<std::size_t>(N) * d) throw std::invalid_argument("head_backward: dx size != B*T*d");
  const auto g = detail::lookup(p, "head.norm", d);
  const auto w = detail::lookup(p, "head.w", static_cast<std::size_t>(d) * V);
  const auto dg = detail::lookup(grads, "head.norm", d);
  const auto dw = detail::lookup(grads, "head.w", static_cast<std::size_t>(d) * V);
  // dlogits = (softmax - onehot) * scale / N, in place over probs: the forward's probabilities are spent.
  const float s = loss_scale / static_cast<float>(N);
  for (int n = 0; n < N; ++n) {
    float* row = cache.probs.data() + static_cast<std::size_t>(n) * V;
    row[cache.targets[n]] -= 1.0f;
    for (int v = 0; v < V; ++v) row[v] *= s;
  }
  detail::gemm(true, false, d, V, N, cache.nrm.data(), cache.probs.data(), dw.data(), 1.0f);  // dW += nrmᵀ·dl
  detail::gemm(false, true, N, d, V, cache.probs.data(), w.data(), dx.data(), 0.0f);          // dnrm = dl·Wᵀ
  detail::rmsnorm_backward(N, d, cache.x.data(), g.data(), cache.r.data(), dx.data(), dx.data(), dg.data());
}

// ---- reference_model ------------------------------------------------------------------------------------------

//! The whole model in one process, every unit resident: the single-rank reference a sharded run is checked
//! against, and what the tests train. Unit u's parameters are params[u], laid out as unit_specs(c)[u].
struct reference_model {
  model_config config;
  std::vector<std::vector<param_spec>> specs;
  std::vector<std::vector<float>> params, grads;  // per unit, flat
  embed_cache embed;
  std::vector<block_cache> blocks;
  head_cache head;
  std::vector<float> x, dx;  // the residual stream and its gradient

  reference_model(const model_config& c, std::uint64_t seed) : config(c), specs(unit_specs(c)), blocks(c.blocks) {
    for (const auto& unit : specs) {
      params.emplace_back(unit_numel(unit));
      grads.emplace_back(unit_numel(unit), 0.0f);
      std::size_t off = 0;
      for (const auto& s : unit) {
        init_param(s, std::span<float>(params.back()).subspan(off, s.numel()), seed);
        off += s.numel();
      }
    }
  }

  param_map unit_params(std::size_t u) const { return slice_unit(specs[u], std::span<const float>(params[u])); }
  grad_map unit_grads(std::size_t u) { return slice_unit(specs[u], std::span<float>(grads[u])); }

  //! The mean loss over the batch's positions; keeps the caches for backward().
  double forward(const batch& in) {
    x.resize(static_cast<std::size_t>(in.rows()) * config.width);
    embed_forward(config, unit_params(0), in, x, embed);
    for (int i = 0; i < config.blocks; ++i) block_forward(config, i, unit_params(i + 1), in.B, in.T, x, x, blocks[i]);
    return head_forward(config, unit_params(config.blocks + 1), in, x, head);
  }

  //! Accumulates (+=) d(loss_scale * loss)/dparams of the last forward() into grads.
  void backward(float loss_scale = 1.0f) {
    dx.resize(x.size());
    const auto L = static_cast<std::size_t>(config.blocks);
    head_backward(config, unit_params(L + 1), head, dx, unit_grads(L + 1), loss_scale);
    for (int i = config.blocks - 1; i >= 0; --i) block_backward(config, i, unit_params(i + 1), blocks[i], dx, dx, unit_grads(i + 1));
    embed_backward(config, embed, dx, unit_grads(0));
  }

  void zero_grads() {
    for (auto& g : grads) std::fill(g.begin(), g.end(), 0.0f);
  }

  void sgd_step(float lr) {
    for (std::size_t u = 0; u < params.size(); ++u)
      for (std::size_t k = 0; k < params[u].size(); ++k) params[u][k] -= lr * grads[u][k];
  }
};

}  // namespace trainer
