// Tree verification for speculative decoding: the per-request walk, written once.
//
// One request b has N tree nodes in topological order; node 0 is the root (the last
// committed token), parents[i] < i, tokens[i] is node i's token. The walk accepts a
// root-to-node path and picks the token that follows it:
//
//   greedy      t = argmax p[cur] (lowest index on ties, NaN counts as the maximum,
//               like torch.argmax); accept the first child c (node order) with
//               tokens[c] == t and continue from c; else stop with next_token = t.
//   stochastic  lossless recursive rejection sampling over siblings that were drawn
//               WITHOUT replacement from q[cur]: r = p[cur], d = q[cur]; for each child
//               c in order accept if u * d(x_c) < r(x_c) (u = next unused uniform);
//               on rejection r = norm(max(r - d, 0)), d(x_c) = 0, d = norm(d). When
//               the children run out, next_token ~ r by inverse CDF with
//               uniforms[N]; at a leaf this is a sample of p[leaf].
//
// The walks are `__host__ __device__` templates written once for both builds. Greedy
// takes the argmax of a node's p row as a function `node_argmax(node)`: the CPU computes
// it on demand for the visited nodes only (SerialOps::argmax); the CUDA build computes
// every node's argmax first, all (request, node) rows in parallel, then runs the walk
// on those (verify_tree_cuda.cu), so a deep path costs no chain of V-long reductions.
// Stochastic takes an `Ops` policy that owns every loop over the vocabulary (sums,
// element-wise update, inverse CDF): `SerialOps` below runs them as plain loops for the
// CPU; the CUDA build's `BlockOps` spreads them over one thread block, with every
// thread running the walk's scalar control flow redundantly (it only depends on
// reduction results that are broadcast to all threads, so the block never diverges).
//
// Numerics that the PyTorch reference (tabed_engine/ops/verify_tree.py) mirrors bit
// for bit on the CPU: sums of probabilities are accumulated in double in increasing
// index order (the reference uses float64 cumsum, which is sequential on the CPU);
// normalisation is float(double(x) / sum); the acceptance test is the fp32 product
// u * d(x) < r(x). The CUDA build sums in a different order (tree reduction), so its
// results can differ from the CPU's only where a draw lands within ~1e-16 relative
// of a decision boundary.
//
// Invalid input never causes out-of-bounds access: a child whose token is outside
// [0, V) is never accepted (it still consumes its uniform) and leaves r, d unchanged;
// parents[] entries are only compared, never used as indices.
#pragma once

#include <cstdint>

#include "common.h"

namespace tabed {

// Arguments of one verify_tree call; strides are in elements. The vocabulary axis of
// p and q must be contiguous. Outputs are contiguous: path [B, N], num_accepted [B],
// next_token [B].
struct VerifyTreeParams {
  int64_t B = 0, N = 0, V = 0;
  const int64_t* tokens = nullptr;  int64_t tokens_sb = 0, tokens_sn = 0;
  const int64_t* parents = nullptr; int64_t parents_sb = 0, parents_sn = 0;
  const void* p = nullptr;          int64_t p_sb = 0, p_sn = 0;
  DType p_dtype = DType::kFloat32;
  const float* q = nullptr;         int64_t q_sb = 0, q_sn = 0;  // stochastic only
  const float* uniforms = nullptr;  int64_t u_sb = 0, u_sn = 0;  // [B, N+1], stochastic only
  bool greedy = true;
  int64_t* path = nullptr;  // CUDA greedy also keeps the node argmaxes here until the walk
  int64_t* num_accepted = nullptr;
  int64_t* next_token = nullptr;
  // Stochastic only: [B, 2, V] fp32 scratch for the residual r and draft d rows. The
  // CPU entry point allocates its own when this is null; CUDA requires it.
  float* workspace = nullptr;
};

// Entry points. Both return a Status code (kOk on success). `stream` is a
// cudaStream_t passed as void* so this header stays free of CUDA includes.
int verify_tree_cpu(const VerifyTreeParams& prm);
int verify_tree_cuda(const VerifyTreeParams& prm, void* stream);

// ---------------------------------------------------------------------------------
// Shared per-request walk.

struct SumPair { double a, b; };

// Next child of `cur` after node `after` (node order), or -1. Scalar, O(N).
TABED_HD int64_t next_child(const int64_t* parents, int64_t sn, int64_t N, int64_t cur,
                            int64_t after) {
  for (int64_t c = after + 1; c < N; ++c)
    if (parents[c * sn] == cur) return c;
  return -1;
}

// Rejection of the child with token x: r <- norm(max(r - d, 0)); d(x) <- 0; d <- norm(d).
// r_src/d_src may alias r_dst/d_dst (each element is read and written by one thread).
//
// Degenerate sums (no NaN ever produced):
//  * sum(max(r - d, 0)) == 0 means r <= d everywhere, i.e. r == d up to rounding.
//    Mathematically the rejection then had probability 0 (u * d(x) < d(x) for all
//    u < 1), so it only happens through fp32 rounding; we continue with the updated
//    draft d (x removed) as the residual, the continuous limit of r as r -> d.
//  * sum(d without x) == 0 means every draft token with mass was already tried
//    (only possible if children were not drawn from d, e.g. top-k); d stays all
//    zero, so a further child x' is accepted iff r(x') > 0 (the min(1, r/d) rule with
//    d = 0), and rejecting it leaves r unchanged.
template <class Ops>
TABED_HD void reject_update(Ops& ops, const float* r_src, const float* d_src, float* r_dst,
                            float* d_dst, int64_t V, int64_t x) {
  const SumPair s = ops.sum_pair(V, [&](int64_t i) {
    const float t = r_src[i] - d_src[i];
    return SumPair{t > 0.f ? double(t) : 0.0, i == x ? 0.0 : double(d_src[i])};
  });
  const double sr = s.a, sd = s.b;
  ops.for_each(V, [&](int64_t i) {
    const float t = r_src[i] - d_src[i];
    const float rt = t > 0.f ? t : 0.f;
    const float dz = i == x ? 0.f : d_src[i];
    const float dn = sd > 0.0 ? float(double(dz) / sd) : dz;
    r_dst[i] = sr > 0.0 ? float(double(rt) / sr) : dn;
    d_dst[i] = dn;
  });
}

// Inverse-CDF sample of the (unnormalised, non-negative) row w with uniform u: the
// first i whose running double sum exceeds u * total. If rounding leaves no such i
// (u * total == total) take the last i with w[i] > 0; an all-zero row gives 0.
template <class Ops>
TABED_HD int64_t sample_row(Ops& ops, const float* w, int64_t V, float u) {
  const double total = ops.sum_pair(V, [&](int64_t i) { return SumPair{double(w[i]), 0.0}; }).a;
  const double target = double(u) * total;
  int64_t idx = ops.first_cum_exceeding(w, V, target);
  if (idx < 0) idx = ops.last_positive(w, V);
  return idx < 0 ? 0 : idx;
}

// One request. Pointers are already offset to request b; node_argmax(i) is the argmax
// of node i's p row. The walk reads node_argmax(cur) before it writes path[n_acc], and
// cur >= n_acc always (path entries increase), so the CUDA build can hold the argmaxes
// in `path` itself: an entry is overwritten only after its last read.
template <class Ops, class ArgmaxFn>
TABED_HD void walk_greedy(Ops& ops, int64_t N, const int64_t* tokens, int64_t tok_sn,
                          const int64_t* parents, int64_t par_sn, ArgmaxFn node_argmax,
                          int64_t* path, int64_t* num_accepted, int64_t* next_token) {
  int64_t cur = 0, n_acc = 0, t = 0;
  for (;;) {
    t = node_argmax(cur);
    if (ops.leader()) path[n_acc] = cur;
    int64_t hit = -1;
    for (int64_t c = next_child(parents, par_sn, N, cur, cur); c >= 0;
         c = next_child(parents, par_sn, N, cur, c)) {
      if (tokens[c * tok_sn] == t) { hit = c; break; }
    }
    if (hit < 0) break;
    cur = hit;
    ++n_acc;
  }
  if (ops.leader()) {
    for (int64_t i = n_acc + 1; i < N; ++i) path[i] = -1;
    *num_accepted = n_acc;
    *next_token = t;
  }
}

template <class Ops>
TABED_HD void walk_stochastic(Ops& ops, int64_t N, int64_t V, const int64_t* tokens,
                              int64_t tok_sn, const int64_t* parents, int64_t par_sn,
                              const float* p, int64_t p_sn, const float* q, int64_t q_sn,
                              const float* uniforms, int64_t u_sn, float* ws_r, float* ws_d,
                              int64_t* path, int64_t* num_accepted, int64_t* next_token) {
  int64_t cur = 0, n_acc = 0, k = 0;
  // r and d point at the input rows until the first rejection at this node
  // (copy-on-write into the workspace), so accepting costs no copy.
  const float* r = p;
  const float* d = q;
  if (ops.leader()) path[0] = 0;
  for (int64_t c = next_child(parents, par_sn, N, cur, cur); c >= 0;
       c = next_child(parents, par_sn, N, cur, c)) {
    const int64_t x = tokens[c * tok_sn];
    const float u = uniforms[(k++) * u_sn];
    if (x < 0 || x >= V) continue;  // never accepted, see the header comment
    if (u * d[x] < r[x]) {
      cur = c;
      ++n_acc;
      if (ops.leader()) path[n_acc] = cur;
      r = p + cur * p_sn;
      d = q + cur * q_sn;
      // the loop continues with the first child of c: next_child(.., cur=c, after=c)
    } else {
      reject_update(ops, r, d, ws_r, ws_d, V, x);
      r = ws_r;
      d = ws_d;
    }
  }
  const int64_t tok = sample_row(ops, r, V, uniforms[N * u_sn]);
  if (ops.leader()) {
    for (int64_t i = n_acc + 1; i < N; ++i) path[i] = -1;
    *num_accepted = n_acc;
    *next_token = tok;
  }
}

// ---------------------------------------------------------------------------------
// CPU policy: plain loops in increasing index order (the order the reference uses).
struct SerialOps {
  TABED_HD bool leader() const { return true; }

  template <class T>
  TABED_HD int64_t argmax(const T* x, int64_t V) {
    using A = typename AccType<T>::type;
    A best = to_acc(x[0]);
    int64_t bi = 0;
    for (int64_t i = 1; i < V; ++i) {
      const A v = to_acc(x[i]);
      if (argmax_better(v, i, best, bi)) { best = v; bi = i; }
    }
    return bi;
  }

  template <class F>
  TABED_HD SumPair sum_pair(int64_t V, F f) {
    SumPair s{0.0, 0.0};
    for (int64_t i = 0; i < V; ++i) {
      const SumPair v = f(i);
      s.a += v.a;
      s.b += v.b;
    }
    return s;
  }

  template <class F>
  TABED_HD void for_each(int64_t V, F f) {
    for (int64_t i = 0; i < V; ++i) f(i);
  }

  TABED_HD int64_t first_cum_exceeding(const float* w, int64_t V, double target) {
    double cum = 0.0;
    for (int64_t i = 0; i < V; ++i) {
      cum += double(w[i]);
      if (cum > target) return i;
    }
    return -1;
  }

  TABED_HD int64_t last_positive(const float* w, int64_t V) {
    for (int64_t i = V - 1; i >= 0; --i)
      if (w[i] > 0.f) return i;
    return -1;
  }
};

}  // namespace tabed
