// Minimal assertion helpers for the core's C++ tests (no framework dependency).
#pragma once

#include <cstdio>
#include <initializer_list>

static int g_failures = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                          \
    }                                                                        \
  } while (0)

#define CHECK_EQ(a, b)                                                       \
  do {                                                                       \
    const long long va_ = (long long)(a), vb_ = (long long)(b);              \
    if (va_ != vb_) {                                                        \
      std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s = %lld, %s = %lld\n", __FILE__, __LINE__, \
                   #a, va_, #b, vb_);                                        \
      ++g_failures;                                                          \
    }                                                                        \
  } while (0)

// main() of a test file: `return run_tests({TEST(test_a), TEST(test_b)});` runs each test,
// prints "ok" or "FAIL" per test and the failure count, and gives the exit status.
struct NamedTest {
  const char* name;
  void (*fn)();
};
#define TEST(fn) NamedTest{#fn, fn}

inline int run_tests(std::initializer_list<NamedTest> tests) {
  for (const NamedTest& t : tests) {
    const int before = g_failures;
    t.fn();
    std::printf("%s %s\n", g_failures == before ? "ok  " : "FAIL", t.name);
  }
  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
