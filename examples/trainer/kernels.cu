// The GPU model's kernels (kernels.hpp says what each computes and why their order is the CPU's). Compiled with
// --fmad=false (examples/CMakeLists.txt): see pointwise.hpp.
#include "kernels.hpp"

#include <cstddef>
#include <stdexcept>
#include <string>

#include "pointwise.hpp"

namespace trainer::kernels {
namespace {

constexpr int threads = 256;

int blocks_for(std::int64_t n) { return static_cast<int>((n + threads - 1) / threads); }

void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("kernel ") + kernel + " did not launch: " + cudaGetErrorString(e));
}

__device__ std::int64_t global_index() { return std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }

// The batch's token rows hold T + 1 bytes: position t's input is byte t, its target byte t + 1.
__device__ unsigned input_of(const std::uint8_t* tokens, int T, int n) { return tokens[(n / T) * (T + 1) + n % T]; }
__device__ unsigned target_of(const std::uint8_t* tokens, int T, int n) { return tokens[(n / T) * (T + 1) + n % T + 1]; }

__global__ void embed_forward_kernel(int N, int T, int d, const std::uint8_t* tokens, const float* tok, const float* pos,
                                     float* x) {
  const std::int64_t k = global_index();
  if (k >= std::int64_t(N) * d) return;
  const int n = int(k / d), j = int(k % d);
  x[k] = tok[std::size_t(input_of(tokens, T, n)) * d + j] + pos[std::size_t(n % T) * d + j];
}

__global__ void embed_backward_kernel(int N, int T, int d, const std::uint8_t* tokens, const float* dx, float* dtok,
                                      float* dpos) {
  const int j = int(global_index());
  if (j >= d) return;
  for (int n = 0; n < N; ++n) {
    const float v = dx[std::size_t(n) * d + j];
    dtok[std::size_t(input_of(tokens, T, n)) * d + j] += v;
    dpos[std::size_t(n % T) * d + j] += v;
  }
}

__global__ void mix_forward_kernel(int N, int T, int d, const float* x, const float* mix, float* u) {
  const std::int64_t k = global_index();
  if (k >= std::int64_t(N) * d) return;
  const int n = int(k / d), j = int(k % d);
  u[k] = x[k] + (n % T == 0 ? 0.0f : mix[j] * x[k - d]);
}

__global__ void mix_grad_kernel(int N, int T, int d, const float* x, const float* du, float* dmix) {
  const int j = int(global_index());
  if (j >= d) return;
  float acc = dmix[j];
  for (int n = 0; n < N; ++n)
    if (n % T != 0) acc += du[std::size_t(n) * d + j] * x[std::size_t(n - 1) * d + j];
  dmix[j] = acc;
}

__global__ void mix_backward_kernel(int N, int T, int d, const float* mix, const float* du, const float* dy, float* dx) {
  const std::int64_t k = global_index();
  if (k >= std::int64_t(N) * d) return;
  const int n = int(k / d), j = int(k % d);
  dx[k] = dy[k] + du[k] + (n % T == T - 1 ? 0.0f : mix[j] * du[k + d]);
}

__global__ void rmsnorm_forward_kernel(int rows, int d, const float* in, const float* g, float* out, float* r,
                                       float eps) {
  const int n = int(global_index());
  if (n >= rows) return;
  const float* x = in + std::size_t(n) * d;
  double ss = 0;
  for (int j = 0; j < d; ++j) ss += double(x[j]) * x[j];
  const float rn = float(1.0 / sqrt(ss / d + eps));
  r[n] = rn;
  float* o = out + std::size_t(n) * d;
  for (int j = 0; j < d; ++j) o[j] = x[j] * rn * g[j];
}

__global__ void rmsnorm_gain_grad_kernel(int rows, int d, const float* in, const float* r, const float* dout, float* dg) {
  const int j = int(global_index());
  if (j >= d) return;
  float acc = dg[j];
  for (int n = 0; n < rows; ++n) acc += dout[std::size_t(n) * d + j] * in[std::size_t(n) * d + j] * r[n];
  dg[j] = acc;
}

__global__ void rmsnorm_input_grad_kernel(int rows, int d, const float* in, const float* g, const float* r,
                                          const float* dout, float* din) {
  const int n = int(global_index());
  if (n >= rows) return;
  const std::size_t o = std::size_t(n) * d;
  double dot = 0;
  for (int j = 0; j < d; ++j) dot += double(g[j]) * dout[o + j] * in[o + j];
  const float c = float(dot / d) * r[n] * r[n];
  for (int j = 0; j < d; ++j) din[o + j] = r[n] * (g[j] * dout[o + j] - in[o + j] * c);
}

__global__ void rows_plus_bias_kernel(int rows, int cols, const float* base, const float* bias, float* out) {
  const std::int64_t k = global_index();
  if (k >= std::int64_t(rows) * cols) return;
  const int j = int(k % cols);
  out[k] = base ? base[k] + bias[j] : bias[j];
}

__global__ void gelu_forward_kernel(std::int64_t count, const float* z, float* a) {
  const std::int64_t k = global_index();
  if (k < count) a[k] = gelu(z[k]);
}

__global__ void gelu_backward_kernel(std::int64_t count, const float* z, float* da) {
  const std::int64_t k = global_index();
  if (k < count) da[k] *= gelu_grad(z[k]);
}

__global__ void add_column_sums_kernel(int rows, int cols, const float* m, float* acc) {
  const int j = int(global_index());
  if (j >= cols) return;
  float a = acc[j];
  for (int n = 0; n < rows; ++n) a += m[std::size_t(n) * cols + j];
  acc[j] = a;
}

__global__ void softmax_cross_entropy_kernel(int N, int T, int V, const std::uint8_t* tokens, float* logits,
                                             double* loss) {
  const int n = int(global_index());
  if (n >= N) return;
  float* row = logits + std::size_t(n) * V;
  float mx = row[0];
  for (int v = 1; v < V; ++v) mx = row[v] > mx ? row[v] : mx;
  double sum = 0;
  for (int v = 0; v < V; ++v) sum += exp(double(row[v]) - mx);
  const double lse = mx + log(sum);
  loss[n] = lse - row[target_of(tokens, T, n)];
  for (int v = 0; v < V; ++v) row[v] = float(exp(double(row[v]) - lse));
}

__global__ void softmax_cross_entropy_backward_kernel(int N, int T, int V, const std::uint8_t* tokens, float scale,
                                                      float* probs) {
  const std::int64_t k = global_index();
  if (k >= std::int64_t(N) * V) return;
  const int n = int(k / V), v = int(k % V);
  const float p = v == int(target_of(tokens, T, n)) ? probs[k] - 1.0f : probs[k];
  probs[k] = p * scale;
}

}  // namespace

void embed_forward(int B, int T, int d, const std::uint8_t* tokens, const float* tok, const float* pos, float* x,
                   cudaStream_t stream) {
  const std::int64_t n = std::int64_t(B) * T * d;
  embed_forward_kernel<<<blocks_for(n), threads, 0, stream>>>(B * T, T, d, tokens, tok, pos, x);
  check_launch("embed_forward");
}

void embed_backward(int B, int T, int d, const std::uint8_t* tokens, const float* dx, float* dtok, float* dpos,
                    cudaStream_t stream) {
  embed_backward_kernel<<<blocks_for(d), threads, 0, stream>>>(B * T, T, d, tokens, dx, dtok, dpos);
  check_launch("embed_backward");
}

void mix_forward(int N, int T, int d, const float* x, const float* mix, float* u, cudaStream_t stream) {
  mix_forward_kernel<<<blocks_for(std::int64_t(N) * d), threads, 0, stream>>>(N, T, d, x, mix, u);
  check_launch("mix_forward");
}

void mix_backward(int N, int T, int d, const float* x, const float* mix, const float* du, const float* dy, float* dx,
                  float* dmix, cudaStream_t stream) {
  mix_grad_kernel<<<blocks_for(d), threads, 0, stream>>>(N, T, d, x, du, dmix);
  check_launch("mix_grad");
  mix_backward_kernel<<<blocks_for(std::int64_t(N) * d), threads, 0, stream>>>(N, T, d, mix, du, dy, dx);
  check_launch("mix_backward");
}

void rmsnorm_forward(int rows, int d, const float* in, const float* g, float* out, float* r, cudaStream_t stream) {
  rmsnorm_forward_kernel<<<blocks_for(rows), threads, 0, stream>>>(rows, d, in, g, out, r, 1e-5f);
  check_launch("rmsnorm_forward");
}

void rmsnorm_backward(int rows, int d, const float* in, const float* g, const float* r, const float* dout, float* din,
                      float* dg, cudaStream_t stream) {
  // The gain's gradient reads dout first: din may overwrite it.
  rmsnorm_gain_grad_kernel<<<blocks_for(d), threads, 0, stream>>>(rows, d, in, r, dout, dg);
  check_launch("rmsnorm_gain_grad");
  rmsnorm_input_grad_kernel<<<blocks_for(rows), threads, 0, stream>>>(rows, d, in, g, r, dout, din);
  check_launch("rmsnorm_input_grad");
}

void rows_plus_bias(int rows, int cols, const float* base, const float* bias, float* out, cudaStream_t stream) {
  rows_plus_bias_kernel<<<blocks_for(std::int64_t(rows) * cols), threads, 0, stream>>>(rows, cols, base, bias, out);
  check_launch("rows_plus_bias");
}

void gelu_forward(std::int64_t count, const float* z, float* a, cudaStream_t stream) {
  gelu_forward_kernel<<<blocks_for(count), threads, 0, stream>>>(count, z, a);
  check_launch("gelu_forward");
}

void gelu_backward(std::int64_t count, const float* z, float* da, cudaStream_t stream) {
  gelu_backward_kernel<<<blocks_for(count), threads, 0, stream>>>(count, z, da);
  check_launch("gelu_backward");
}

void add_column_sums(int rows, int cols, const float* m, float* acc, cudaStream_t stream) {
  add_column_sums_kernel<<<blocks_for(cols), threads, 0, stream>>>(rows, cols, m, acc);
  check_launch("add_column_sums");
}

void softmax_cross_entropy(int B, int T, int V, const std::uint8_t* tokens, float* logits, double* loss,
                           cudaStream_t stream) {
  softmax_cross_entropy_kernel<<<blocks_for(B * T), threads, 0, stream>>>(B * T, T, V, tokens, logits, loss);
  check_launch("softmax_cross_entropy");
}

void softmax_cross_entropy_backward(int B, int T, int V, const std::uint8_t* tokens, float scale, float* probs,
                                    cudaStream_t stream) {
  const std::int64_t n = std::int64_t(B) * T * V;
  softmax_cross_entropy_backward_kernel<<<blocks_for(n), threads, 0, stream>>>(B * T, T, V, tokens, scale, probs);
  check_launch("softmax_cross_entropy_backward");
}

}  // namespace trainer::kernels
