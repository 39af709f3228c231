// Unit tests of the verify_tree core (CPU entry point, shared walk), no torch.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "verify_tree.h"

using tabed::DType;
using tabed::VerifyTreeParams;

namespace {

// One request's tree with contiguous [N] / [N, V] buffers.
struct Tree {
  int64_t N, V;
  std::vector<int64_t> tokens, parents;
  std::vector<float> p, q, u;
  std::vector<int64_t> path;
  int64_t num_accepted = -7, next_token = -7;
  Tree(int64_t n, int64_t v)
      : N(n), V(v), tokens(n, 0), parents(n, -1), p(n * v, 0.f), q(n * v, 0.f), u(n + 1, 0.5f), path(n, -7) {}
  float* prow(int64_t i) { return &p[i * V]; }
  float* qrow(int64_t i) { return &q[i * V]; }
  void node(int64_t i, int64_t parent, int64_t token) { parents[i] = parent; tokens[i] = token; }

  int run(bool greedy) {
    VerifyTreeParams a;
    a.B = 1; a.N = N; a.V = V;
    a.tokens = tokens.data(); a.tokens_sb = N; a.tokens_sn = 1;
    a.parents = parents.data(); a.parents_sb = N; a.parents_sn = 1;
    a.p = p.data(); a.p_sb = N * V; a.p_sn = V; a.p_dtype = DType::kFloat32;
    a.q = q.data(); a.q_sb = N * V; a.q_sn = V;
    a.uniforms = u.data(); a.u_sb = N + 1; a.u_sn = 1;
    a.greedy = greedy;
    a.path = path.data(); a.num_accepted = &num_accepted; a.next_token = &next_token;
    return tabed::verify_tree_cpu(a);
  }
};

// root -> {1: tok 4, 2: tok 2}; 1 -> {3: tok 1, 4: tok 0}; 2 -> {5: tok 3}
Tree sample_tree() {
  Tree t(6, 5);
  t.node(1, 0, 4); t.node(2, 0, 2); t.node(3, 1, 1); t.node(4, 1, 0); t.node(5, 2, 3);
  return t;
}

void test_greedy_walk() {
  Tree t = sample_tree();
  t.prow(0)[2] = 1.f;  // argmax 2 -> node 2 (second sibling)
  t.prow(2)[3] = 5.f;  // argmax 3 -> node 5
  t.prow(5)[1] = 2.f;  // leaf: next token 1
  CHECK_EQ(t.run(true), tabed::kOk);
  CHECK_EQ(t.num_accepted, 2);
  CHECK_EQ(t.next_token, 1);
  const int64_t want[6] = {0, 2, 5, -1, -1, -1};
  for (int i = 0; i < 6; ++i) CHECK_EQ(t.path[i], want[i]);
}

void test_greedy_stop_and_ties() {
  Tree t = sample_tree();
  // root argmax: tie between 0 and 4 -> lowest index 0, no child has token 0 -> stop.
  t.prow(0)[0] = 3.f; t.prow(0)[4] = 3.f;
  CHECK_EQ(t.run(true), tabed::kOk);
  CHECK_EQ(t.num_accepted, 0);
  CHECK_EQ(t.next_token, 0);
  CHECK_EQ(t.path[0], 0);
  CHECK_EQ(t.path[1], -1);
  // NaN counts as the maximum (torch.argmax semantics): NaN at 4 -> node 1 accepted.
  t.prow(0)[4] = std::numeric_limits<float>::quiet_NaN();
  t.prow(1)[3] = 1.f;  // node 1 argmax 3, children tokens 1 and 0 -> stop
  CHECK_EQ(t.run(true), tabed::kOk);
  CHECK_EQ(t.num_accepted, 1);
  CHECK_EQ(t.path[1], 1);
  CHECK_EQ(t.next_token, 3);
}

void test_greedy_first_matching_sibling() {
  // Two siblings with the same token: the first in node order wins.
  Tree t(3, 4);
  t.node(1, 0, 2); t.node(2, 0, 2);
  t.prow(0)[2] = 1.f;
  CHECK_EQ(t.run(true), tabed::kOk);
  CHECK_EQ(t.num_accepted, 1);
  CHECK_EQ(t.path[1], 1);
}

// The CUDA build stores every node's argmax in `path` and walks on it (trees too large
// to stage in shared memory): walk_greedy must read an entry before overwriting it.
// Random trees, including chains where node i is accepted as the i-th path entry (the
// entry written is the node read next), must walk the same as with argmaxes on demand.
void test_greedy_walk_on_argmaxes_in_path() {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t N = 1 + int64_t(rng() % 40), V = 6;
    Tree t(N, V);
    for (int64_t i = 1; i < N; ++i) {
      const int64_t parent = trial % 2 ? i - 1 : int64_t(rng() % uint32_t(i));
      t.node(i, parent, int64_t(rng() % V));
    }
    for (float& x : t.p) x = float(rng() % 4);
    CHECK_EQ(t.run(true), tabed::kOk);
    std::vector<int64_t> path(N);
    tabed::SerialOps ops;
    for (int64_t i = 0; i < N; ++i) path[i] = ops.argmax(t.prow(i), V);
    int64_t nacc = -7, next = -7;
    const int64_t* best = path.data();
    tabed::walk_greedy(ops, N, t.tokens.data(), 1, t.parents.data(), 1,
                       [best](int64_t node) { return best[node]; }, path.data(), &nacc, &next);
    CHECK_EQ(nacc, t.num_accepted);
    CHECK_EQ(next, t.next_token);
    for (int64_t i = 0; i < N; ++i) CHECK_EQ(path[i], t.path[i]);
  }
}

// bf16 / fp16 / fp64 rows give the same argmax as their float values.
void test_greedy_dtypes() {
  const int64_t N = 2, V = 7;
  std::vector<int64_t> tokens = {0, 5}, parents = {-1, 0};
  const float vals[V] = {0.5f, -2.f, 1.25f, 3.f, 3.f, 2.75f, -0.f};
  std::vector<uint16_t> bf(N * V), hf(N * V);
  std::vector<double> dv(N * V);
  const uint16_t half_bits[V] = {0x3800, 0xc000, 0x3d00, 0x4200, 0x4200, 0x4180, 0x8000};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < V; ++i) {
      uint32_t b;
      std::memcpy(&b, &vals[i], 4);
      bf[n * V + i] = uint16_t(b >> 16);
      hf[n * V + i] = half_bits[i];
      dv[n * V + i] = vals[i];
    }
  for (int k = 0; k < 3; ++k) {
    std::vector<int64_t> path(N, -7);
    int64_t nacc = -7, next = -7;
    VerifyTreeParams a;
    a.B = 1; a.N = N; a.V = V;
    a.tokens = tokens.data(); a.tokens_sn = 1;
    a.parents = parents.data(); a.parents_sn = 1;
    a.p_sn = V;
    a.p = k == 0 ? (const void*)bf.data() : k == 1 ? (const void*)hf.data() : (const void*)dv.data();
    a.p_dtype = k == 0 ? DType::kBFloat16 : k == 1 ? DType::kFloat16 : DType::kFloat64;
    a.path = path.data(); a.num_accepted = &nacc; a.next_token = &next;
    CHECK_EQ(tabed::verify_tree_cpu(a), tabed::kOk);
    CHECK_EQ(next, 3);  // tie 3/4 -> 3; child token 5 is not the argmax
    CHECK_EQ(nacc, 0);
  }
}

void test_half_conversion() {
  // Every finite half bit pattern against a float computed from the definition.
  int bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t e = (h >> 10) & 31, m = h & 1023;
    if (e == 31) continue;
    const double mag = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + m / 1024.0, int(e) - 15);
    const float want = float((h & 0x8000) ? -mag : mag);
    const float got = tabed::to_acc(tabed::Half{uint16_t(h)});
    if (std::memcmp(&want, &got, 4) != 0) ++bad;
  }
  CHECK_EQ(bad, 0);
  CHECK(std::isinf(tabed::to_acc(tabed::Half{0x7c00})));
  CHECK(std::isnan(tabed::to_acc(tabed::Half{0x7e00})));
}

void test_stochastic_equal_distributions_accept() {
  // p == q at every node: the first child is always accepted (u * d(x) < d(x) for u < 1).
  Tree t = sample_tree();
  for (int64_t n = 0; n < t.N; ++n)
    for (int64_t i = 0; i < t.V; ++i) t.prow(n)[i] = t.qrow(n)[i] = 0.2f;
  for (float u : {0.f, 0.5f, 0.9999f}) {
    for (auto& x : t.u) x = u;
    CHECK_EQ(t.run(false), tabed::kOk);
    CHECK_EQ(t.num_accepted, 2);
    CHECK_EQ(t.path[1], 1);
    CHECK_EQ(t.path[2], 3);
    CHECK_EQ(t.path[3], -1);
  }
}

void test_stochastic_reject_all_then_residual() {
  // Target puts all mass on token 3 at the root, which no root child carries:
  // both children are rejected whatever u, and the residual is one-hot at 3.
  Tree t = sample_tree();
  t.prow(0)[3] = 1.f;
  for (int64_t i = 0; i < t.V; ++i) t.qrow(0)[i] = 0.2f;
  for (float u : {0.f, 0.3f, 0.99f}) {
    for (auto& x : t.u) x = u;
    CHECK_EQ(t.run(false), tabed::kOk);
    CHECK_EQ(t.num_accepted, 0);
    CHECK_EQ(t.next_token, 3);
    CHECK_EQ(t.path[1], -1);
  }
}

void test_stochastic_threshold_and_residual() {
  // Root children: node 1 token 0, node 2 token 1. p = [.1, .6, .3, 0, 0],
  // q = [.5, .25, .25, 0, 0]. Child 1 accepted iff u0 * .5 < .1 (u0 < .2).
  // After rejecting token 0: r = norm(max(p - q, 0)) = [0, .35, .05]/.4,
  // d = [0, .25, .25]/.5 = [0, .5, .5]. Child 2 accepted iff u1 * .5 < .875.
  // After rejecting token 1 (u1 >= ... impossible: .875/.5 > 1) -> always accepted.
  Tree t(3, 5);
  t.node(1, 0, 0); t.node(2, 0, 1);
  const float p0[5] = {.1f, .6f, .3f, 0.f, 0.f}, q0[5] = {.5f, .25f, .25f, 0.f, 0.f};
  std::memcpy(t.prow(0), p0, sizeof p0);
  std::memcpy(t.qrow(0), q0, sizeof q0);
  t.prow(1)[4] = 1.f; t.prow(2)[2] = 1.f;  // leaves: next token 4 / 2
  t.u = {0.19f, 0.99f, 0.f, 0.5f};
  CHECK_EQ(t.run(false), tabed::kOk);
  CHECK_EQ(t.num_accepted, 1); CHECK_EQ(t.path[1], 1); CHECK_EQ(t.next_token, 4);
  t.u = {0.21f, 0.99f, 0.f, 0.5f};
  CHECK_EQ(t.run(false), tabed::kOk);
  CHECK_EQ(t.num_accepted, 1); CHECK_EQ(t.path[1], 2); CHECK_EQ(t.next_token, 2);
  // Now make the residual matter: child 2 carries token 2 (r(2) = .125, d(2) = .5):
  // accepted iff u1 < .25; else r = norm(max(r - d, 0)) = one-hot at 1 -> next 1.
  t.node(2, 0, 2);
  t.u = {0.5f, 0.24f, 0.f, 0.5f};
  CHECK_EQ(t.run(false), tabed::kOk);
  CHECK_EQ(t.num_accepted, 1); CHECK_EQ(t.path[1], 2); CHECK_EQ(t.next_token, 2);
  t.u = {0.5f, 0.26f, 0.f, 0.999f};
  CHECK_EQ(t.run(false), tabed::kOk);
  CHECK_EQ(t.num_accepted, 0); CHECK_EQ(t.next_token, 1);
}

void test_stochastic_inverse_cdf() {
  // Root without children: next token ~ p[root] by inverse CDF with uniforms[N].
  Tree t(1, 4);
  const float p0[4] = {0.f, .25f, 0.f, .75f};
  std::memcpy(t.prow(0), p0, sizeof p0);
  const float us[5] = {0.f, .2499f, .25f, .9f, 0.99999994f};
  const int64_t want[5] = {1, 1, 3, 3, 3};
  for (int k = 0; k < 5; ++k) {
    t.u[1] = us[k];
    CHECK_EQ(t.run(false), tabed::kOk);
    CHECK_EQ(t.next_token, want[k]);
    CHECK_EQ(t.num_accepted, 0);
  }
  // All-zero row: no NaN, token 0.
  std::memset(t.prow(0), 0, 4 * sizeof(float));
  CHECK_EQ(t.run(false), tabed::kOk);
  CHECK_EQ(t.next_token, 0);
}

void test_invalid_tokens_and_parents() {
  // Out-of-range child tokens are never accepted and never indexed; garbage parents
  // (>= own index) are just never children of anyone reachable.
  Tree t(4, 3);
  t.node(1, 0, 7); t.node(2, 0, -1); t.node(3, 3, 0);
  for (int64_t n = 0; n < 4; ++n)
    for (int64_t i = 0; i < 3; ++i) t.prow(n)[i] = t.qrow(n)[i] = 1.f / 3;
  CHECK_EQ(t.run(false), tabed::kOk);
  CHECK_EQ(t.num_accepted, 0);
  CHECK(t.next_token >= 0 && t.next_token < 3);
  CHECK_EQ(t.run(true), tabed::kOk);
  CHECK_EQ(t.num_accepted, 0);
  CHECK_EQ(t.next_token, 0);
}

void test_error_codes() {
  Tree t = sample_tree();
  VerifyTreeParams a;
  a.B = 1; a.N = 0; a.V = 5;
  CHECK_EQ(tabed::verify_tree_cpu(a), tabed::kErrInvalidArgument);
  a.N = 6;
  CHECK_EQ(tabed::verify_tree_cpu(a), tabed::kErrInvalidArgument);  // null pointers
  a.tokens = t.tokens.data(); a.parents = t.parents.data(); a.p = t.p.data();
  a.path = t.path.data(); a.num_accepted = &t.num_accepted; a.next_token = &t.next_token;
  a.greedy = false; a.p_dtype = DType::kBFloat16;
  CHECK_EQ(tabed::verify_tree_cpu(a), tabed::kErrUnsupportedDtype);
  a.p_dtype = DType::kFloat32;
  CHECK_EQ(tabed::verify_tree_cpu(a), tabed::kErrInvalidArgument);  // q, uniforms missing
  a.B = 0;
  CHECK_EQ(tabed::verify_tree_cpu(a), tabed::kOk);
}

// Batched, strided call == per-request contiguous calls (strides and batch offsets).
void test_batch_strides() {
  const int64_t B = 3, N = 9, V = 11;
  std::mt19937 rng(123);
  std::uniform_real_distribution<float> U(0.f, 1.f);
  // tokens/parents stored with stride 2 along N; p/q rows padded to V + 5.
  const int64_t sn = 2, pv = V + 5;
  std::vector<int64_t> tok(B * N * sn, 99), par(B * N * sn, 99);
  std::vector<float> p(B * N * pv), q(B * N * pv), u(B * (N + 1) * 2);
  for (auto& x : p) x = U(rng);
  for (auto& x : q) x = U(rng);
  for (auto& x : u) x = U(rng);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i) {
      par[(b * N + i) * sn] = i == 0 ? -1 : int64_t(rng() % i);
      tok[(b * N + i) * sn] = int64_t(rng() % V);
    }
  for (int greedy = 0; greedy < 2; ++greedy) {
    std::vector<int64_t> path(B * N, -7), nacc(B, -7), next(B, -7);
    VerifyTreeParams a;
    a.B = B; a.N = N; a.V = V;
    a.tokens = tok.data(); a.tokens_sb = N * sn; a.tokens_sn = sn;
    a.parents = par.data(); a.parents_sb = N * sn; a.parents_sn = sn;
    a.p = p.data(); a.p_sb = N * pv; a.p_sn = pv;
    a.q = q.data(); a.q_sb = N * pv; a.q_sn = pv;
    a.uniforms = u.data(); a.u_sb = (N + 1) * 2; a.u_sn = 2;
    a.greedy = greedy != 0;
    a.path = path.data(); a.num_accepted = nacc.data(); a.next_token = next.data();
    CHECK_EQ(tabed::verify_tree_cpu(a), tabed::kOk);
    for (int64_t b = 0; b < B; ++b) {
      Tree t(N, V);
      for (int64_t i = 0; i < N; ++i) {
        t.node(i, par[(b * N + i) * sn], tok[(b * N + i) * sn]);
        std::memcpy(t.prow(i), &p[(b * N + i) * pv], V * sizeof(float));
        std::memcpy(t.qrow(i), &q[(b * N + i) * pv], V * sizeof(float));
      }
      for (int64_t i = 0; i <= N; ++i) t.u[i] = u[b * (N + 1) * 2 + i * 2];
      CHECK_EQ(t.run(greedy != 0), tabed::kOk);
      CHECK_EQ(t.num_accepted, nacc[b]);
      CHECK_EQ(t.next_token, next[b]);
      for (int64_t i = 0; i < N; ++i) CHECK_EQ(t.path[i], path[b * N + i]);
    }
  }
}

}  // namespace

int main() {
  return run_tests({TEST(test_greedy_walk), TEST(test_greedy_stop_and_ties), TEST(test_greedy_first_matching_sibling),
                    TEST(test_greedy_walk_on_argmaxes_in_path),
                    TEST(test_greedy_dtypes), TEST(test_half_conversion),
                    TEST(test_stochastic_equal_distributions_accept), TEST(test_stochastic_reject_all_then_residual),
                    TEST(test_stochastic_threshold_and_residual), TEST(test_stochastic_inverse_cdf),
                    TEST(test_invalid_tokens_and_parents), TEST(test_error_codes), TEST(test_batch_strides)});
}
