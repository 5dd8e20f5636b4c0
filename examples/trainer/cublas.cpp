// cuBLAS for the trainer's GPU path, opened with dlopen when --device cuda asks for it. The trainer is one binary
// for the CPU and the GPU: linked against cuBLAS, every CPU run would load libcublas and libcublasLt (about 600 MB
// with CUDA 13) and a GPU host bundle could not carry them; opened here, a CPU run never touches them and a GPU
// run uses the host's CUDA install, and a host without them gets one line saying which library was not found.
//
// The row-major products of model.hpp map onto column-major cuBLAS by computing Cᵀ = op(B)ᵀ·op(A)ᵀ: the same
// matrices read with their dimensions swapped. Pedantic math mode: no TF32 or other reduced-precision shortcut, so
// a product differs from OpenBLAS's only in the order its sums run.
#include <cublas_api.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.hpp"

namespace trainer::kernels {
namespace {

class cublas_library {
 public:
  //! Opens libcublas.so.<this toolkit's major> (then the neighbouring majors, whose sgemm ABI is the same) and makes
  //! a handle on the calling thread's current device.
  cublas_library() {
    std::string tried;
    for (int major : {CUBLAS_VER_MAJOR, CUBLAS_VER_MAJOR + 1, CUBLAS_VER_MAJOR - 1}) {
      const std::string name = "libcublas.so." + std::to_string(major);
      if ((lib_ = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL))) {
        soname_ = name;
        break;
      }
      const char* why = dlerror();
      tried += (tried.empty() ? "" : "; ") + (why ? std::string(why) : name + " not found");
    }
    if (!lib_)
      throw std::runtime_error("--device cuda: cuBLAS not found (" + tried +
                               "): put the CUDA toolkit's lib64 (or pip's nvidia/cublas/lib) on LD_LIBRARY_PATH");
    create_ = symbol<decltype(&cublasCreate_v2)>("cublasCreate_v2");
    destroy_ = symbol<decltype(&cublasDestroy_v2)>("cublasDestroy_v2");
    sgemm_ = symbol<decltype(&cublasSgemm_v2)>("cublasSgemm_v2");
    auto set_math = symbol<decltype(&cublasSetMathMode)>("cublasSetMathMode");
    auto version = symbol<decltype(&cublasGetVersion_v2)>("cublasGetVersion_v2");
    check(create_(&handle_), "cublasCreate");
    check(set_math(handle_, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
    check(version(handle_, &version_), "cublasGetVersion");
  }
  cublas_library(const cublas_library&) = delete;
  cublas_library& operator=(const cublas_library&) = delete;
  ~cublas_library() {
    if (handle_) destroy_(handle_);
    // The library stays loaded: CUDA's own teardown at exit may still call into it.
  }

  //! C[M,N] = alpha * op(A)·op(B) + beta * C, row-major and dense, on the legacy default stream (model.hpp's gemm).
  void gemm(bool ta, bool tb, int M, int N, int K, const float* A, const float* B, float* C, float beta,
            float alpha = 1.0f) {
    check(sgemm_(handle_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B,
                 tb ? K : N, A, ta ? M : K, &beta, C, N),
          "cublasSgemm");
  }

  //! "cuBLAS 13.0.2 (libcublas.so.13)"
  std::string description() const {
    return "cuBLAS " + std::to_string(version_ / 10000) + "." + std::to_string(version_ / 100 % 100) + "." +
           std::to_string(version_ % 100) + " (" + soname_ + ")";
  }

 private:
  template <class F>
  F symbol(const char* name) {
    if (void* p = dlsym(lib_, name)) return reinterpret_cast<F>(p);
    throw std::runtime_error("--device cuda: " + soname_ + " has no " + name);
  }
  static void check(cublasStatus_t s, const char* call) {
    if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(call) + " failed: status " + std::to_string(int(s)));
  }

  void* lib_ = nullptr;
  std::string soname_;
  cublasHandle_t handle_ = nullptr;
  int version_ = 0;
  decltype(&cublasCreate_v2) create_ = nullptr;
  decltype(&cublasDestroy_v2) destroy_ = nullptr;
  decltype(&cublasSgemm_v2) sgemm_ = nullptr;
};

}  // namespace

struct device_blas::state {
  int device;
  cublas_library cublas;
};

device_blas::device_blas(int device) : state_(std::make_unique<state>(device)) {}
device_blas::~device_blas() = default;

void device_blas::gemm(bool ta, bool tb, int M, int N, int K, const float* A, const float* B, float* C, float beta,
                       float alpha) {
  state_->cublas.gemm(ta, tb, M, N, K, A, B, C, beta, alpha);
}

std::string device_blas::description() const {
  cudaDeviceProp prop{};
  const std::string name = cudaGetDeviceProperties(&prop, state_->device) == cudaSuccess ? prop.name : "unknown";
  return state_->cublas.description() + " on cuda:" + std::to_string(state_->device) + " (" + name + ")";
}

}  // namespace trainer::kernels
