// CUDA entry point of verify_tree: one thread block per request runs the shared walk
// (verify_tree.h) with BlockOps, which spreads every loop over the vocabulary across
// the block's threads. All threads execute the walk's scalar control flow; it only
// depends on reduction results broadcast through shared memory, so it stays uniform
// and __syncthreads() inside the ops is always reached by the whole block.
#include <cuda_runtime.h>

#include <cstdint>

#include "verify_tree.h"

namespace tabed {

namespace {

constexpr unsigned kFull = 0xffffffffu;

template <int NT>
struct BlockShared {
  double a[NT / 32];
  double b[NT / 32];
  int64_t i[NT / 32];
  double ba, bb;
  int64_t bi;
};

template <int NT>
struct BlockOps {
  static_assert(NT % 32 == 0 && NT <= 1024, "block size");
  BlockShared<NT>* sh;

  __device__ bool leader() const { return threadIdx.x == 0; }

  // argmax: (value, index) pairs combined with argmax_better (NaN max, lowest index).
  template <class T>
  __device__ int64_t argmax(const T* x, int64_t V) {
    using A = typename AccType<T>::type;
    A best = A(0);
    int64_t bi = -1;  // -1: this thread saw no element
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < V; i += NT) {
      const A v = to_acc(x[i]);
      if (bi < 0 || argmax_better(v, i, best, bi)) { best = v; bi = i; }
    }
    double bv = double(best);  // exact widening keeps order and NaN
    bv = warp_argmax(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sh->a[warp] = bv; sh->i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
      double v = lane < NT / 32 ? sh->a[lane] : 0.0;
      int64_t i = lane < NT / 32 ? sh->i[lane] : -1;
      v = warp_argmax(v, i);
      if (lane == 0) sh->bi = i;
    }
    __syncthreads();
    return sh->bi;
  }

  template <class F>
  __device__ SumPair sum_pair(int64_t V, F f) {
    SumPair s{0.0, 0.0};
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < V; i += NT) {
      const SumPair v = f(i);
      s.a += v.a;
      s.b += v.b;
    }
    for (int off = 16; off > 0; off >>= 1) {
      s.a += __shfl_down_sync(kFull, s.a, off);
      s.b += __shfl_down_sync(kFull, s.b, off);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sh->a[warp] = s.a; sh->b[warp] = s.b; }
    __syncthreads();
    if (warp == 0) {
      double a = lane < NT / 32 ? sh->a[lane] : 0.0;
      double b = lane < NT / 32 ? sh->b[lane] : 0.0;
      for (int off = 16; off > 0; off >>= 1) {
        a += __shfl_down_sync(kFull, a, off);
        b += __shfl_down_sync(kFull, b, off);
      }
      if (lane == 0) { sh->ba = a; sh->bb = b; }
    }
    __syncthreads();
    return SumPair{sh->ba, sh->bb};
  }

  template <class F>
  __device__ void for_each(int64_t V, F f) {
    for (int64_t i = threadIdx.x; i < V; i += NT) f(i);
    __syncthreads();
  }

  // Each thread owns a contiguous chunk; a block exclusive scan of the chunk sums gives
  // each chunk's starting cumulative value, then chunks are scanned sequentially.
  __device__ int64_t first_cum_exceeding(const float* w, int64_t V, double target) {
    const int64_t chunk = (V + NT - 1) / NT;
    const int64_t start = int64_t(threadIdx.x) * chunk;
    const int64_t lo = start < V ? start : V;
    const int64_t hi = lo + chunk < V ? lo + chunk : V;
    double local = 0.0;
    for (int64_t i = lo; i < hi; ++i) local += double(w[i]);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double incl = local;  // inclusive warp scan
    for (int off = 1; off < 32; off <<= 1) {
      const double o = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += o;
    }
    if (lane == 31) sh->a[warp] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {  // exclusive scan of the NT/32 warp totals, serially
      double run = 0.0;
      for (int j = 0; j < NT / 32; ++j) { const double t = sh->a[j]; sh->b[j] = run; run += t; }
    }
    __syncthreads();
    double cum = sh->b[warp] + (incl - local);
    int64_t found = INT64_MAX;
    for (int64_t i = lo; i < hi; ++i) {
      cum += double(w[i]);
      if (cum > target) { found = i; break; }
    }
    const int64_t r = reduce_i64(found, true);
    return r == INT64_MAX ? -1 : r;
  }

  __device__ int64_t last_positive(const float* w, int64_t V) {
    int64_t best = -1;
    for (int64_t i = threadIdx.x; i < V; i += NT)
      if (w[i] > 0.f) best = i;  // increasing i: keeps the largest
    return reduce_i64(best, false);
  }

 private:
  __device__ static double warp_argmax(double v, int64_t& i) {
    for (int off = 16; off > 0; off >>= 1) {
      const double ov = __shfl_down_sync(kFull, v, off);
      const int64_t oi = __shfl_down_sync(kFull, i, off);
      if (oi >= 0 && (i < 0 || argmax_better(ov, oi, v, i))) { v = ov; i = oi; }
    }
    return v;
  }

  __device__ int64_t reduce_i64(int64_t x, bool is_min) {
    for (int off = 16; off > 0; off >>= 1) {
      const int64_t o = __shfl_down_sync(kFull, x, off);
      x = (is_min ? o < x : o > x) ? o : x;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sh->i[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int64_t v = lane < NT / 32 ? sh->i[lane] : (is_min ? INT64_MAX : int64_t(-1));
      for (int off = 16; off > 0; off >>= 1) {
        const int64_t o = __shfl_down_sync(kFull, v, off);
        v = (is_min ? o < v : o > v) ? o : v;
      }
      if (lane == 0) sh->bi = v;
    }
    __syncthreads();
    return sh->bi;
  }
};

template <class T, int NT>
__global__ void __launch_bounds__(NT) verify_greedy_kernel(VerifyTreeParams a) {
  __shared__ BlockShared<NT> sh;
  BlockOps<NT> ops{&sh};
  const int64_t b = blockIdx.x;
  walk_greedy(ops, a.N, a.V, a.tokens + b * a.tokens_sb, a.tokens_sn, a.parents + b * a.parents_sb,
              a.parents_sn, static_cast<const T*>(a.p) + b * a.p_sb, a.p_sn, a.path + b * a.N,
              a.num_accepted + b, a.next_token + b);
}

template <int NT>
__global__ void __launch_bounds__(NT) verify_stochastic_kernel(VerifyTreeParams a) {
  __shared__ BlockShared<NT> sh;
  BlockOps<NT> ops{&sh};
  const int64_t b = blockIdx.x;
  float* ws = a.workspace + b * 2 * a.V;
  walk_stochastic(ops, a.N, a.V, a.tokens + b * a.tokens_sb, a.tokens_sn,
                  a.parents + b * a.parents_sb, a.parents_sn,
                  static_cast<const float*>(a.p) + b * a.p_sb, a.p_sn, a.q + b * a.q_sb, a.q_sn,
                  a.uniforms + b * a.u_sb, a.u_sn, ws, ws + a.V, a.path + b * a.N,
                  a.num_accepted + b, a.next_token + b);
}

template <int NT>
void launch(const VerifyTreeParams& a, cudaStream_t s) {
  const dim3 grid(unsigned(a.B));
  if (!a.greedy) {
    verify_stochastic_kernel<NT><<<grid, NT, 0, s>>>(a);
    return;
  }
  switch (a.p_dtype) {
    case DType::kFloat32: verify_greedy_kernel<float, NT><<<grid, NT, 0, s>>>(a); break;
    case DType::kFloat64: verify_greedy_kernel<double, NT><<<grid, NT, 0, s>>>(a); break;
    case DType::kFloat16: verify_greedy_kernel<Half, NT><<<grid, NT, 0, s>>>(a); break;
    case DType::kBFloat16: verify_greedy_kernel<BFloat16, NT><<<grid, NT, 0, s>>>(a); break;
  }
}

}  // namespace

int verify_tree_cuda(const VerifyTreeParams& a, void* stream) {
  if (a.B < 0 || a.N < 1 || a.V < 1) return kErrInvalidArgument;
  if (a.B == 0) return kOk;
  if (a.B > int64_t(0x7fffffff)) return kErrTooLarge;
  if (!a.tokens || !a.parents || !a.p || !a.path || !a.num_accepted || !a.next_token)
    return kErrInvalidArgument;
  if (!a.greedy) {
    if (a.p_dtype != DType::kFloat32) return kErrUnsupportedDtype;
    if (!a.q || !a.uniforms || !a.workspace) return kErrInvalidArgument;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Small vocabularies (tests, toy models) would leave most of a 512-thread block idle.
  if (a.V <= 4096)
    launch<128>(a, s);
  else
    launch<512>(a, s);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? kOk : kErrCudaBase + int(err);
}

}  // namespace tabed
