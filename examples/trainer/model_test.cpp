#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "model.hpp"

namespace {

using namespace trainer;

model_config tiny_config() { return {.vocab = 256, .context = 5, .width = 8, .hidden = 16, .blocks = 2}; }

// Moves every parameter off its init (gains off 1, biases and mix off 0, weights to O(0.3)) so that no term of the
// backward is multiplied by an exact 0 or 1 and left untested, and the gradients are well above f32 noise.
void perturb(reference_model& m, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (auto& unit : m.params)
    for (float& v : unit) v += nd(rng);
}

// |a - b| <= atol + rtol * max(|a|, |b|)
bool close(double a, double b, double rtol, double atol) {
  return std::abs(a - b) <= atol + rtol * std::max(std::abs(a), std::abs(b));
}

constexpr double fd_eps = 1e-3, fd_rtol = 1e-2, fd_atol = 2e-4;

}  // namespace

TEST_CASE("[trainer] unit layout: embed, L blocks, head; at least 8 units by default") {
  const model_config c;
  const auto names = unit_names(c);
  const auto specs = unit_specs(c);
  REQUIRE(names.size() == specs.size());
  CHECK(names.size() >= 8);
  CHECK(names.front() == "embed");
  CHECK(names[1] == "block0");
  CHECK(names.back() == "head");
  for (std::size_t u = 0; u < names.size(); ++u)
    for (const auto& s : specs[u]) CHECK(s.name.rfind(names[u] + ".", 0) == 0);
  CHECK(specs[1][2].name == "block0.w1");
  CHECK(specs[1][2].shape == std::vector<std::size_t>{64, 256});
  CHECK(unit_numel(specs.back()) == 64 + 64 * 256);
}

TEST_CASE("[trainer] init is deterministic, keyed on (name, seed) only") {
  const param_spec w{"block3.w1", {16, 32}};
  std::vector<float> a(w.numel()), b(w.numel()), other(w.numel()), reseeded(w.numel());
  init_param(w, a, 7);
  init_param(w, b, 7);
  CHECK(a == b);
  init_param({"block4.w1", {16, 32}}, other, 7);
  CHECK(a != other);
  init_param(w, reseeded, 8);
  CHECK(a != reseeded);

  // The same name in a differently shaped unit layout (another config) starts from the same prefix of values:
  // the index, not the shape or the position among the specs, keys an element.
  std::vector<float> longer(2 * w.numel());
  init_param({"block3.w1", {32, 32}}, longer, 7);
  CHECK(std::equal(a.begin(), a.end(), longer.begin()));

  double sum = 0, sq = 0;
  std::vector<float> big(1 << 16);
  init_param({"head.w", {256, 256}}, big, 1);
  for (float v : big) sum += v, sq += double(v) * v;
  const double mean = sum / big.size(), sd = std::sqrt(sq / big.size() - mean * mean);
  CHECK(std::abs(mean) < 1e-3);
  CHECK(sd == doctest::Approx(0.02).epsilon(0.02));

  std::vector<float> g(8), bias(8), mix(8);
  init_param({"block0.norm", {8}}, g, 1);
  init_param({"block0.b2", {8}}, bias, 1);
  init_param({"block0.mix", {8}}, mix, 1);
  CHECK(std::all_of(g.begin(), g.end(), [](float v) { return v == 1.0f; }));
  CHECK(std::all_of(bias.begin(), bias.end(), [](float v) { return v == 0.0f; }));
  CHECK(std::all_of(mix.begin(), mix.end(), [](float v) { return v == 0.0f; }));

  // Whole models built twice agree bit for bit.
  reference_model m1(tiny_config(), 3), m2(tiny_config(), 3);
  CHECK(m1.params == m2.params);
}

TEST_CASE("[trainer] make_batch: equal row splits reproduce the global batch") {
  const std::string text = training_text();
  CHECK(text.size() > 3000);
  const int B = 8, T = 16;
  const batch global = make_batch(text, B, T, 5, 42);
  CHECK(global.B == B);
  CHECK(global.T == T);
  CHECK(global.tokens.size() == static_cast<std::size_t>(B * (T + 1)));
  CHECK(make_batch(text, B, T, 5, 42).tokens == global.tokens);
  CHECK(make_batch(text, B, T, 6, 42).tokens != global.tokens);
  CHECK(make_batch(text, B, T, 5, 43).tokens != global.tokens);
  for (int world : {1, 2, 4, 8}) {
    std::vector<std::uint8_t> joined;
    for (int rank = 0; rank < world; ++rank) {
      const batch part = make_batch(text, B, T, 5, 42, rank * (B / world), B / world);
      CHECK(part.B == B / world);
      joined.insert(joined.end(), part.tokens.begin(), part.tokens.end());
    }
    CHECK(joined == global.tokens);
  }
  // Targets are the inputs shifted by one.
  for (int t = 0; t + 1 < T; ++t) CHECK(global.target(1, t) == global.input(1, t + 1));
  CHECK_THROWS_AS(make_batch(text, B, T, 0, 0, 6, 4), std::invalid_argument);
}

TEST_CASE("[trainer] fast_tanh is within 3e-7 relative of tanh, odd, and saturates to exactly +-1") {
  double worst = 0, worst_at = 0;
  // Dense over both branches and the seam at 0.55, then tiny and huge magnitudes.
  for (int i = -1'200'000; i <= 1'200'000; ++i) {
    const float x = static_cast<float>(i) * 1e-5f;
    const double want = std::tanh(static_cast<double>(x)), got = fast_tanh(x);
    const double rel = want == 0 ? std::abs(got) : std::abs(got - want) / std::abs(want);
    if (rel > worst) worst = rel, worst_at = x;
  }
  INFO("worst relative error " << worst << " at x = " << worst_at);
  CHECK(worst <= 3e-7);
  for (float x : {1e-30f, 1e-10f, 3e-4f, 0.5499f, 0.55f, 0.5501f, 2.0f, 8.9f}) {
    CHECK(fast_tanh(-x) == -fast_tanh(x));
    CHECK(close(fast_tanh(x), std::tanh(static_cast<double>(x)), 3e-7, 0));
  }
  for (float x : {9.0f, 20.0f, 1e30f, INFINITY}) {
    CHECK(fast_tanh(x) == 1.0f);
    CHECK(fast_tanh(-x) == -1.0f);
  }
  CHECK(std::isnan(fast_tanh(NAN)));
}

TEST_CASE("[trainer] backward matches central finite differences for every parameter") {
  const model_config c = tiny_config();
  reference_model m(c, 11);
  perturb(m, 12);
  const batch in = make_batch(training_text(), 2, c.context, 0, 13);
  m.zero_grads();
  m.forward(in);
  m.backward();
  const auto analytic = m.grads;

  int checked = 0, nonzero = 0;
  double worst = 0;
  for (std::size_t u = 0; u < m.params.size(); ++u) {
    std::size_t off = 0;
    for (const auto& spec : m.specs[u]) {
      for (std::size_t k = 0; k < spec.numel(); ++k) {
        float& p = m.params[u][off + k];
        const float saved = p;
        p = static_cast<float>(saved + fd_eps);
        const double up = m.forward(in);
        p = static_cast<float>(saved - fd_eps);
        const double down = m.forward(in);
        p = saved;
        const double fd = (up - down) / (2 * fd_eps), an = analytic[u][off + k];
        if (!close(fd, an, fd_rtol, fd_atol))
          FAIL_CHECK(spec.name << "[" << k << "]: analytic " << an << " vs finite difference " << fd);
        worst = std::max(worst, std::abs(fd - an) / (fd_atol + fd_rtol * std::max(std::abs(fd), std::abs(an))));
        ++checked;
        nonzero += std::abs(an) > 1e-3;
      }
      off += spec.numel();
    }
  }
  MESSAGE(checked << " parameters checked, " << nonzero << " with |grad| > 1e-3; worst error / allowed " << worst);
  CHECK(nonzero > 500);
}

TEST_CASE("[trainer] block backward: dX matches finite differences on the block's input") {
  const model_config c = tiny_config();
  reference_model m(c, 21);
  perturb(m, 22);
  const batch in = make_batch(training_text(), 2, c.context, 1, 23);
  const std::size_t n = static_cast<std::size_t>(in.rows()) * c.width;
  const auto L = static_cast<std::size_t>(c.blocks);

  std::vector<float> x0(n);
  embed_forward(c, m.unit_params(0), in, x0, m.embed);
  // The loss as a function of block k's input.
  auto loss_from = [&](int k, std::vector<float> x) {
    for (int i = k; i < c.blocks; ++i) block_forward(c, i, m.unit_params(i + 1), in.B, in.T, x, x, m.blocks[i]);
    return head_forward(c, m.unit_params(L + 1), in, x, m.head);
  };
  for (int k = 0; k < c.blocks; ++k) {
    std::vector<float> xk = x0;
    for (int i = 0; i < k; ++i) block_forward(c, i, m.unit_params(i + 1), in.B, in.T, xk, xk, m.blocks[i]);
    loss_from(k, xk);
    std::vector<float> dx(n);
    m.zero_grads();
    head_backward(c, m.unit_params(L + 1), m.head, dx, m.unit_grads(L + 1));
    for (int i = c.blocks - 1; i >= k; --i) {
      std::vector<float> dy = dx;  // separate buffers here: the reference model covers dx aliasing dy
      block_backward(c, i, m.unit_params(i + 1), m.blocks[i], dy, dx, m.unit_grads(i + 1));
    }
    for (std::size_t j = 0; j < n; ++j) {
      std::vector<float> xp = xk, xm = xk;
      xp[j] += static_cast<float>(fd_eps);
      xm[j] -= static_cast<float>(fd_eps);
      const double fd = (loss_from(k, xp) - loss_from(k, xm)) / (2 * fd_eps);
      if (!close(fd, dx[j], fd_rtol, fd_atol))
        FAIL_CHECK("block" << k << " dx[" << j << "]: analytic " << dx[j] << " vs finite difference " << fd);
    }
  }
}

TEST_CASE("[trainer] gradients accumulate, and rank-mean gradients equal the full-batch gradient") {
  const model_config c = tiny_config();
  reference_model m(c, 31);
  perturb(m, 32);
  const std::string text = training_text();
  const batch full = make_batch(text, 4, c.context, 9, 33);

  m.zero_grads();
  m.forward(full);
  m.backward();
  const auto once = m.grads;
  m.forward(full);
  m.backward();
  for (std::size_t u = 0; u < once.size(); ++u)
    for (std::size_t k = 0; k < once[u].size(); ++k) REQUIRE(m.grads[u][k] == doctest::Approx(2 * once[u][k]));

  // Two "ranks" with two rows each; what FSDP does is average their gradients. Accumulating with loss_scale 1/2
  // is that average.
  m.zero_grads();
  for (int rank = 0; rank < 2; ++rank) {
    m.forward(make_batch(text, 4, c.context, 9, 33, rank * 2, 2));
    m.backward(0.5f);
  }
  for (std::size_t u = 0; u < once.size(); ++u)
    for (std::size_t k = 0; k < once[u].size(); ++k)
      if (!close(m.grads[u][k], once[u][k], 1e-4, 1e-6))
        FAIL_CHECK("unit " << u << " [" << k << "]: rank mean " << m.grads[u][k] << " vs full " << once[u][k]);
}

TEST_CASE("[trainer] 50 steps of SGD lower the loss") {
  const model_config c{.vocab = 256, .context = 32, .width = 32, .hidden = 128, .blocks = 6};
  reference_model m(c, 1);
  const std::string text = training_text();
  // A fixed held-out set of windows (another seed) measures before and after.
  auto eval = [&] {
    double s = 0;
    for (int i = 0; i < 4; ++i) s += m.forward(make_batch(text, 8, c.context, i, 999));
    return s / 4;
  };
  const double initial = eval();
  CHECK(initial == doctest::Approx(std::log(256.0)).epsilon(0.01));
  double last = 0;
  for (int step = 0; step < 50; ++step) {
    m.zero_grads();
    last = m.forward(make_batch(text, 8, c.context, step, 7));
    m.backward();
    m.sgd_step(0.5f);
    if (step % 10 == 0 || step == 49) MESSAGE("step " << step << " train loss " << last);
  }
  const double final_loss = eval();
  MESSAGE("eval loss " << initial << " -> " << final_loss);
  CHECK(final_loss < 0.6 * initial);  // seen: 5.55 -> 2.63 (0.47)
}
