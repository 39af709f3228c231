// CUDA entry point of verify_tree.
//
// Greedy, two launches: `node_argmax_kernel` takes the argmax of every (request, node)
// p row at once, one block per row (16-byte loads, the row's loads in flight together),
// and stores it in `path`; `greedy_walk_kernel` then runs the shared walk
// (verify_tree.h) per request on those argmaxes, a few scalar steps per tree level.
// The walk was serial in tree depth before, one V-long block reduction per visited
// node (59-93 us for trees of up to 64 nodes over V = 32064 on an H200); now the rows
// are read in one parallel sweep, which also reads the nodes the walk never visits.
//
// Stochastic: one thread block per request runs the shared walk with BlockOps, which
// spreads every loop over the vocabulary across the block's threads. All threads
// execute the walk's scalar control flow; it only depends on reduction results
// broadcast through shared memory, so it stays uniform and __syncthreads() inside the
// ops is always reached by the whole block.
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

// Lane 0 gets the warp's best (value, index) by argmax_better (NaN max, lowest index);
// index -1 marks a lane that saw no element.
__device__ double warp_argmax(double v, int64_t& i) {
  for (int off = 16; off > 0; off >>= 1) {
    const double ov = __shfl_down_sync(kFull, v, off);
    const int64_t oi = __shfl_down_sync(kFull, i, off);
    if (oi >= 0 && (i < 0 || argmax_better(ov, oi, v, i))) { v = ov; i = oi; }
  }
  return v;
}

template <int NT>
struct BlockOps {
  static_assert(NT % 32 == 0 && NT <= 1024, "block size");
  BlockShared<NT>* sh;

  __device__ bool leader() const { return threadIdx.x == 0; }

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

// One block per (request, node) row r = b * N + node: path[b, node] (= path + r, path
// is contiguous [B, N]) <- argmax of the row. VEC: the rows are 16-byte aligned, read as
// uint4 vectors, kUnroll of them per thread in flight before any is compared.
template <class T, int NT, bool VEC>
__global__ void __launch_bounds__(NT) node_argmax_kernel(VerifyTreeParams a) {
  using A = typename AccType<T>::type;
  __shared__ double sh_v[NT / 32];
  __shared__ int64_t sh_i[NT / 32];
  const int64_t r = blockIdx.x;
  const int64_t b = r / a.N;
  const T* x = static_cast<const T*>(a.p) + b * a.p_sb + (r - b * a.N) * a.p_sn;
  A best = A(0);
  int64_t bi = -1;  // -1: this thread saw no element
  // A thread visits its elements in increasing index order, so "strictly better" is
  // argmax_better without the index test: a larger value, or the first NaN.
  const auto visit = [&](A v, int64_t i) {
    if (bi < 0 || v > best || (is_nan(v) && !is_nan(best))) { best = v; bi = i; }
  };
  int64_t tail = 0;  // first element of the scalar loop
  if (VEC) {
    constexpr int kVec = 16 / int(sizeof(T));
    constexpr int kUnroll = 8;
    union Pack { uint4 u; T t[kVec]; };
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int64_t nvec = a.V / kVec;
    for (int64_t j0 = threadIdx.x; j0 < nvec; j0 += int64_t(kUnroll) * NT) {
      Pack pk[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = j0 + int64_t(u) * NT;
        pk[u].u = j < nvec ? __ldg(xv + j) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = j0 + int64_t(u) * NT;
        if (j < nvec) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) visit(to_acc(pk[u].t[k]), j * kVec + k);
        }
      }
    }
    tail = nvec * kVec;
  }
  for (int64_t i = tail + threadIdx.x; i < a.V; i += NT) visit(to_acc(x[i]), i);

  double bv = warp_argmax(double(best), bi);  // exact widening keeps order and NaN
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sh_v[warp] = bv; sh_i[warp] = bi; }
  __syncthreads();
  if (warp == 0) {
    bv = lane < NT / 32 ? sh_v[lane] : 0.0;
    bi = lane < NT / 32 ? sh_i[lane] : -1;
    warp_argmax(bv, bi);
    if (lane == 0) a.path[r] = bi;
  }
}

// Trees up to this many nodes are staged in shared memory for the walk (3 x 4 KiB).
constexpr int kStageNodes = 512;
constexpr int kWalkThreads = 128;

// One block per request: stage tokens, parents and the node argmaxes (in path) in
// shared memory with all threads, then thread 0 walks. Larger trees walk on global
// memory, reading the argmaxes from path as the walk overwrites it (see walk_greedy).
__global__ void __launch_bounds__(kWalkThreads) greedy_walk_kernel(VerifyTreeParams a) {
  __shared__ int64_t s_tok[kStageNodes], s_par[kStageNodes], s_best[kStageNodes];
  const int64_t b = blockIdx.x;
  const int64_t* tokens = a.tokens + b * a.tokens_sb;
  const int64_t* parents = a.parents + b * a.parents_sb;
  int64_t tok_sn = a.tokens_sn, par_sn = a.parents_sn;
  int64_t* path = a.path + b * a.N;
  const int64_t* best = path;
  if (a.N <= kStageNodes) {  // uniform over the block
    for (int64_t i = threadIdx.x; i < a.N; i += kWalkThreads) {
      s_tok[i] = tokens[i * tok_sn];
      s_par[i] = parents[i * par_sn];
      s_best[i] = path[i];
    }
    __syncthreads();
    tokens = s_tok;
    parents = s_par;
    best = s_best;
    tok_sn = par_sn = 1;
  }
  if (threadIdx.x != 0) return;
  SerialOps ops;
  walk_greedy(ops, a.N, tokens, tok_sn, parents, par_sn, [best](int64_t node) { return best[node]; },
              path, a.num_accepted + b, a.next_token + b);
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

template <class T, int NT>
void launch_greedy(const VerifyTreeParams& a, cudaStream_t s) {
  const bool vec = reinterpret_cast<uintptr_t>(a.p) % 16 == 0 && (a.p_sb * int64_t(sizeof(T))) % 16 == 0 &&
                   (a.p_sn * int64_t(sizeof(T))) % 16 == 0;
  const dim3 rows(unsigned(a.B * a.N));
  if (vec)
    node_argmax_kernel<T, NT, true><<<rows, NT, 0, s>>>(a);
  else
    node_argmax_kernel<T, NT, false><<<rows, NT, 0, s>>>(a);
  greedy_walk_kernel<<<unsigned(a.B), kWalkThreads, 0, s>>>(a);
}

template <int NT>
void launch(const VerifyTreeParams& a, cudaStream_t s) {
  if (!a.greedy) {
    verify_stochastic_kernel<NT><<<unsigned(a.B), NT, 0, s>>>(a);
    return;
  }
  switch (a.p_dtype) {
    case DType::kFloat32: launch_greedy<float, NT>(a, s); break;
    case DType::kFloat64: launch_greedy<double, NT>(a, s); break;
    case DType::kFloat16: launch_greedy<Half, NT>(a, s); break;
    case DType::kBFloat16: launch_greedy<BFloat16, NT>(a, s); break;
  }
}

}  // namespace

int verify_tree_cuda(const VerifyTreeParams& a, void* stream) {
  if (a.B < 0 || a.N < 1 || a.V < 1) return kErrInvalidArgument;
  if (a.B == 0) return kOk;
  if (a.B > int64_t(0x7fffffff) || (a.greedy && a.B * a.N > int64_t(0x7fffffff))) return kErrTooLarge;
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
