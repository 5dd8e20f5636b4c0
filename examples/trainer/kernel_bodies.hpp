#pragma once
// The bodies of the GPU model's kernels (kernels.hpp says what each launcher computes), one index of a launch
// each, and the launchers over them. Included by exactly one translation unit of a program, which first defines
// `launch<Body>(name, n, stream, args...)`: kernels.cu runs Body::at(k, args...) for k < n as a CUDA grid; the
// host twin of the GPU path (tests/nccl/trainer_cuda_model.cpp) runs the same bodies in a loop over host memory,
// so the index arithmetic tested there is the one that runs on the GPU.
//
// A row's sums run in one index, a column's sums over the rows in one index, in the CPU loops' order.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels.hpp"
#include "pointwise.hpp"

namespace trainer::kernels {
namespace body {

// The batch's token rows hold T + 1 bytes: position t's input is byte t, its target byte t + 1.
TRAINER_HOST_DEVICE inline unsigned input_of(const std::uint8_t* tokens, int T, int n) {
  return tokens[(n / T) * (T + 1) + n % T];
}
TRAINER_HOST_DEVICE inline unsigned target_of(const std::uint8_t* tokens, int T, int n) {
  return tokens[(n / T) * (T + 1) + n % T + 1];
}

struct embed_forward {  // index: element (n, j)
  TRAINER_HOST_DEVICE static void at(std::int64_t k, int T, int d, const std::uint8_t* tokens, const float* tok,
                                     const float* pos, float* x) {
    const int n = int(k / d), j = int(k % d);
    x[k] = tok[std::size_t(input_of(tokens, T, n)) * d + j] + pos[std::size_t(n % T) * d + j];
  }
};

struct embed_backward {  // index: column j
  TRAINER_HOST_DEVICE static void at(std::int64_t j, int N, int T, int d, const std::uint8_t* tokens, const float* dx,
                                     float* dtok, float* dpos) {
    for (int n = 0; n < N; ++n) {
      const float v = dx[std::size_t(n) * d + j];
      dtok[std::size_t(input_of(tokens, T, n)) * d + j] += v;
      dpos[std::size_t(n % T) * d + j] += v;
    }
  }
};

struct mix_forward {  // index: element
  TRAINER_HOST_DEVICE static void at(std::int64_t k, int T, int d, const float* x, const float* mix, float* u) {
    const int n = int(k / d), j = int(k % d);
    u[k] = x[k] + (n % T == 0 ? 0.0f : mix[j] * x[k - d]);
  }
};

struct mix_grad {  // index: column
  TRAINER_HOST_DEVICE static void at(std::int64_t j, int N, int T, int d, const float* x, const float* du, float* dmix) {
    float acc = dmix[j];
    for (int n = 0; n < N; ++n)
      if (n % T != 0) acc += du[std::size_t(n) * d + j] * x[std::size_t(n - 1) * d + j];
    dmix[j] = acc;
  }
};

struct mix_backward {  // index: element
  TRAINER_HOST_DEVICE static void at(std::int64_t k, int T, int d, const float* mix, const float* du, const float* dy,
                                     float* dx) {
    const int n = int(k / d), j = int(k % d);
    dx[k] = dy[k] + du[k] + (n % T == T - 1 ? 0.0f : mix[j] * du[k + d]);
  }
};

struct rmsnorm_forward {  // index: row
  TRAINER_HOST_DEVICE static void at(std::int64_t n, int d, const float* in, const float* g, float* out, float* r,
                                     float eps) {
    const float* x = in + std::size_t(n) * d;
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += double(x[j]) * x[j];
    const float rn = float(1.0 / sqrt(ss / d + eps));
    r[n] = rn;
    float* o = out + std::size_t(n) * d;
    for (int j = 0; j < d; ++j) o[j] = x[j] * rn * g[j];
  }
};

struct rmsnorm_gain_grad {  // index: column
  TRAINER_HOST_DEVICE static void at(std::int64_t j, int rows, int d, const float* in, const float* r, const float* dout,
                                     float* dg) {
    float acc = dg[j];
    for (int n = 0; n < rows; ++n) acc += dout[std::size_t(n) * d + j] * in[std::size_t(n) * d + j] * r[n];
    dg[j] = acc;
  }
};

struct rmsnorm_input_grad {  // index: row
  TRAINER_HOST_DEVICE static void at(std::int64_t n, int d, const float* in, const float* g, const float* r,
                                     const float* dout, float* din) {
    const std::size_t o = std::size_t(n) * d;
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += double(g[j]) * dout[o + j] * in[o + j];
    const float c = float(dot / d) * r[n] * r[n];
    for (int j = 0; j < d; ++j) din[o + j] = r[n] * (g[j] * dout[o + j] - in[o + j] * c);
  }
};

struct rows_plus_bias {  // index: element
  TRAINER_HOST_DEVICE static void at(std::int64_t k, int cols, const float* base, const float* bias, float* out) {
    const int j = int(k % cols);
    out[k] = base ? base[k] + bias[j] : bias[j];
  }
};

struct gelu_forward {
  TRAINER_HOST_DEVICE static void at(std::int64_t k, const float* z, float* a) { a[k] = gelu(z[k]); }
};

struct gelu_backward {
  TRAINER_HOST_DEVICE static void at(std::int64_t k, const float* z, float* da) { da[k] *= gelu_grad(z[k]); }
};

struct add_column_sums {  // index: column
  TRAINER_HOST_DEVICE static void at(std::int64_t j, int rows, int cols, const float* m, float* acc) {
    float a = acc[j];
    for (int n = 0; n < rows; ++n) a += m[std::size_t(n) * cols + j];
    acc[j] = a;
  }
};

struct softmax_cross_entropy {  // index: row
  TRAINER_HOST_DEVICE static void at(std::int64_t n, int T, int V, const std::uint8_t* tokens, float* logits,
                                     double* loss) {
    float* row = logits + std::size_t(n) * V;
    float mx = row[0];
    for (int v = 1; v < V; ++v) mx = row[v] > mx ? row[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += exp(double(row[v]) - mx);
    const double lse = mx + log(sum);
    loss[n] = lse - row[target_of(tokens, T, int(n))];
    for (int v = 0; v < V; ++v) row[v] = float(exp(double(row[v]) - lse));
  }
};

struct softmax_cross_entropy_backward {  // index: element
  TRAINER_HOST_DEVICE static void at(std::int64_t k, int T, int V, const std::uint8_t* tokens, float scale,
                                     float* probs) {
    const int n = int(k / V), v = int(k % V);
    const float p = v == int(target_of(tokens, T, n)) ? probs[k] - 1.0f : probs[k];
    probs[k] = p * scale;
  }
};

}  // namespace body

void embed_forward(int B, int T, int d, const std::uint8_t* tokens, const float* tok, const float* pos, float* x,
                   cudaStream_t stream) {
  launch<body::embed_forward>("embed_forward", std::int64_t(B) * T * d, stream, T, d, tokens, tok, pos, x);
}

void embed_backward(int B, int T, int d, const std::uint8_t* tokens, const float* dx, float* dtok, float* dpos,
                    cudaStream_t stream) {
  launch<body::embed_backward>("embed_backward", d, stream, B * T, T, d, tokens, dx, dtok, dpos);
}

void mix_forward(int N, int T, int d, const float* x, const float* mix, float* u, cudaStream_t stream) {
  launch<body::mix_forward>("mix_forward", std::int64_t(N) * d, stream, T, d, x, mix, u);
}

void mix_backward(int N, int T, int d, const float* x, const float* mix, const float* du, const float* dy, float* dx,
                  float* dmix, cudaStream_t stream) {
  launch<body::mix_grad>("mix_grad", d, stream, N, T, d, x, du, dmix);
  launch<body::mix_backward>("mix_backward", std::int64_t(N) * d, stream, T, d, mix, du, dy, dx);
}

void rmsnorm_forward(int rows, int d, const float* in, const float* g, float* out, float* r, cudaStream_t stream) {
  launch<body::rmsnorm_forward>("rmsnorm_forward", rows, stream, d, in, g, out, r, 1e-5f);  // model.hpp's rms_eps
}

void rmsnorm_backward(int rows, int d, const float* in, const float* g, const float* r, const float* dout, float* din,
                      float* dg, cudaStream_t stream) {
  // The gain's gradient reads dout first: din may overwrite it.
  launch<body::rmsnorm_gain_grad>("rmsnorm_gain_grad", d, stream, rows, d, in, r, dout, dg);
  launch<body::rmsnorm_input_grad>("rmsnorm_input_grad", rows, stream, d, in, g, r, dout, din);
}

void rows_plus_bias(int rows, int cols, const float* base, const float* bias, float* out, cudaStream_t stream) {
  launch<body::rows_plus_bias>("rows_plus_bias", std::int64_t(rows) * cols, stream, cols, base, bias, out);
}

void gelu_forward(std::int64_t count, const float* z, float* a, cudaStream_t stream) {
  launch<body::gelu_forward>("gelu_forward", count, stream, z, a);
}

void gelu_backward(std::int64_t count, const float* z, float* da, cudaStream_t stream) {
  launch<body::gelu_backward>("gelu_backward", count, stream, z, da);
}

void add_column_sums(int rows, int cols, const float* m, float* acc, cudaStream_t stream) {
  launch<body::add_column_sums>("add_column_sums", cols, stream, rows, cols, m, acc);
}

void softmax_cross_entropy(int B, int T, int V, const std::uint8_t* tokens, float* logits, double* loss,
                           cudaStream_t stream) {
  launch<body::softmax_cross_entropy>("softmax_cross_entropy", std::int64_t(B) * T, stream, T, V, tokens, logits, loss);
}

void softmax_cross_entropy_backward(int B, int T, int V, const std::uint8_t* tokens, float scale, float* probs,
                                    cudaStream_t stream) {
  launch<body::softmax_cross_entropy_backward>("softmax_cross_entropy_backward", std::int64_t(B) * T * V, stream, T,
                                               V, tokens, scale, probs);
}

}  // namespace trainer::kernels
