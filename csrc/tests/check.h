// Minimal assertion helpers for the core's C++ tests (no framework dependency).
#pragma once

#include <cstdio>

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

#define RUN(test)                      \
  do {                                 \
    const int before_ = g_failures;    \
    test();                            \
    std::printf("%s %s\n", g_failures == before_ ? "ok  " : "FAIL", #test); \
  } while (0)
