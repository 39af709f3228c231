// Unit tests of the compact_kv core (CPU entry point), no torch.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "compact_kv.h"

using tabed::CompactKVParams;

namespace {

// Caches [L, R, H, S, D] of T, filled with distinct values (value = flat index).
template <class T>
struct Caches {
  int64_t L, R, H, S, D;
  std::vector<T> k, v;
  Caches(int64_t l, int64_t r, int64_t h, int64_t s, int64_t d) : L(l), R(r), H(h), S(s), D(d) {
    k.resize(size_t(L * R * H * S * D));
    v.resize(k.size());
    for (size_t i = 0; i < k.size(); ++i) { k[i] = T(i); v[i] = T(i + k.size()); }
  }
  int64_t at(int64_t l, int64_t r, int64_t h, int64_t s, int64_t d) const {
    return (((l * R + r) * H + h) * S + s) * D + d;
  }
};

// The caches as a paged pool: one page of S slots per row, row r's table [r].
std::vector<int32_t> g_table;

template <class T>
CompactKVParams params(Caches<T>& c, const std::vector<int32_t>& lengths, const std::vector<int64_t>& path,
                       int64_t N, const std::vector<int64_t>& nacc) {
  CompactKVParams a;
  a.L = c.L; a.R = c.R; a.H = c.H; a.S = c.S; a.D = c.D; a.page = c.S;
  a.elem_size = sizeof(T);
  const int64_t ss = c.D, sh = c.S * ss, sp = c.H * sh, sl = c.R * sp;
  a.k = c.k.data(); a.k_sl = sl; a.k_sp = sp; a.k_sh = sh; a.k_ss = ss;
  a.v = c.v.data(); a.v_sl = sl; a.v_sp = sp; a.v_sh = sh; a.v_ss = ss;
  g_table.resize(size_t(c.R));
  for (int64_t r = 0; r < c.R; ++r) g_table[size_t(r)] = int32_t(r);
  a.table = g_table.data(); a.table_sr = 1;
  a.lengths = lengths.data();
  a.path = path.data(); a.path_sr = N; a.path_sn = 1; a.N = N;
  a.num_accepted = nacc.data();
  return a;
}

// Naive model: new[len + i] = old[len + path[i]] for valid entries, from a full copy.
template <class T>
void model(Caches<T>& c, const std::vector<int32_t>& lengths, const std::vector<int64_t>& path, int64_t N,
           const std::vector<int64_t>& nacc) {
  const std::vector<T> k0 = c.k, v0 = c.v;
  for (int64_t r = 0; r < c.R; ++r) {
    const int64_t len = lengths[r];
    const int64_t n = std::min<int64_t>(std::max<int64_t>(nacc[r], 0), N - 1) + 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pi = path[r * N + i];
      if (len < 0 || pi < 0 || len + pi >= c.S || len + i >= c.S) continue;
      for (int64_t l = 0; l < c.L; ++l)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t d = 0; d < c.D; ++d) {
            c.k[c.at(l, r, h, len + i, d)] = k0[c.at(l, r, h, len + pi, d)];
            c.v[c.at(l, r, h, len + i, d)] = v0[c.at(l, r, h, len + pi, d)];
          }
    }
  }
}

void test_overlapping_path() {
  // path [0, 2, 3]: slot 2 is the source of entry 1 and the destination of entry 2.
  Caches<float> c(2, 1, 2, 10, 3), m = c;
  std::vector<int32_t> lengths = {4};
  std::vector<int64_t> path = {0, 2, 3, -1}, nacc = {2};
  CHECK_EQ(tabed::compact_kv_cpu(params(c, lengths, path, 4, nacc)), tabed::kOk);
  for (int64_t l = 0; l < 2; ++l)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 3; ++d) {
        CHECK_EQ(c.k[c.at(l, 0, h, 5, d)], m.k[m.at(l, 0, h, 6, d)]);
        CHECK_EQ(c.k[c.at(l, 0, h, 6, d)], m.k[m.at(l, 0, h, 7, d)]);
        CHECK_EQ(c.v[c.at(l, 0, h, 6, d)], m.v[m.at(l, 0, h, 7, d)]);
        CHECK_EQ(c.k[c.at(l, 0, h, 7, d)], m.k[m.at(l, 0, h, 7, d)]);  // untouched
        CHECK_EQ(c.k[c.at(l, 0, h, 4, d)], m.k[m.at(l, 0, h, 4, d)]);  // root stays
      }
}

// Non-monotonic path: gather semantics (not in-order copying) is what the spec says.
void test_gather_semantics() {
  Caches<double> c(1, 1, 1, 8, 2), m = c;
  std::vector<int32_t> lengths = {1};
  std::vector<int64_t> path = {0, 3, 1}, nacc = {2};
  CHECK_EQ(tabed::compact_kv_cpu(params(c, lengths, path, 3, nacc)), tabed::kOk);
  model(m, lengths, path, 3, nacc);
  CHECK(c.k == m.k && c.v == m.v);
  CHECK_EQ(c.k[c.at(0, 0, 0, 3, 0)], 2 * 2);  // old slot 2 (= len + path[2])
}

void test_random_against_model() {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t L = 1 + rng() % 3, R = 1 + rng() % 5, H = 1 + rng() % 3, S = 4 + rng() % 30,
                  D = 1 + rng() % 9, N = 1 + rng() % 12;
    Caches<uint16_t> c(L, R, H, S, D);  // 2-byte elements, like bf16
    Caches<uint16_t> m = c;
    std::vector<int32_t> lengths(R);
    std::vector<int64_t> path(R * N, -1), nacc(R);
    for (int64_t r = 0; r < R; ++r) {
      lengths[r] = int32_t(rng() % S) - (trial % 10 == 0 ? 1 : 0);  // some -1, some near S
      nacc[r] = int64_t(rng() % (N + 2)) - 1;                        // out of range both sides
      int64_t node = 0;
      path[r * N] = 0;
      for (int64_t i = 1; i < N; ++i) {
        node += 1 + rng() % 3;
        path[r * N + i] = (rng() % 8 == 0) ? -1 : node;
      }
    }
    CHECK_EQ(tabed::compact_kv_cpu(params(c, lengths, path, N, nacc)), tabed::kOk);
    model(m, lengths, path, N, nacc);
    CHECK(c.k == m.k);
    CHECK(c.v == m.v);
  }
}

void test_errors() {
  Caches<float> c(1, 1, 1, 4, 2);
  std::vector<int32_t> lengths = {0};
  std::vector<int64_t> path = {0}, nacc = {0};
  CompactKVParams a = params(c, lengths, path, 1, nacc);
  a.N = 0;
  CHECK_EQ(tabed::compact_kv_cpu(a), tabed::kErrInvalidArgument);
  a.N = 1; a.lengths = nullptr;
  CHECK_EQ(tabed::compact_kv_cpu(a), tabed::kErrInvalidArgument);
}

}  // namespace

int main() {
  return run_tests({TEST(test_overlapping_path), TEST(test_gather_semantics), TEST(test_random_against_model),
                    TEST(test_errors)});
}
