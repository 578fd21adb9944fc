/*
 * tests/c/ng_test.h - the little the ctest binaries share: a seeded RNG,
 * the |d| <= atol + rtol*|ref| comparison, and pass/fail bookkeeping.
 * Exit codes: 0 all passed, 1 a failure, 77 everything skipped.
 */
#ifndef NG_TEST_H
#define NG_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cpu_isa.h"

static int ng_test_failures = 0;
static int ng_test_checks = 0;

typedef struct ng_rng {
    uint64_t s;
} ng_rng;

static inline uint64_t ng_rng_u64(ng_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in [-1, 1) */
static inline double ng_rng_unif(ng_rng *r) {
    return (double)(ng_rng_u64(r) >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/* Compare n values; report the first few mismatches under `what`. NaN in the
 * reference must be NaN in the result (and vice versa). */
static inline int ng_expect_close(const char *what, const double *got, const double *ref, int64_t n,
                                  double atol, double rtol) {
    int bad = 0;
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs(got[i] - ref[i]);
        int ok = (isnan(ref[i]) && isnan(got[i])) || (isinf(ref[i]) && got[i] == ref[i]) ||
                 (isfinite(got[i]) && d <= atol + rtol * fabs(ref[i]));
        if (!ok) {
            if (bad < 3)
                fprintf(stderr, "  %s[%lld]: got %.9g want %.9g\n", what, (long long)i, got[i],
                        ref[i]);
            bad++;
        } else if (isfinite(d) && d > worst) {
            worst = d;
        }
    }
    ng_test_checks++;
    if (bad) {
        fprintf(stderr, "FAIL %s: %d of %lld outside atol=%g rtol=%g\n", what, bad, (long long)n,
                atol, rtol);
        ng_test_failures++;
    }
    return bad == 0;
}

#define NG_EXPECT(cond)                                                                            \
    do {                                                                                           \
        ng_test_checks++;                                                                          \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                        \
            ng_test_failures++;                                                                    \
        }                                                                                          \
    } while (0)

/* NG_EXPECT with a printf-style message after the condition. */
#define NG_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        ng_test_checks++;                                                                          \
        if (!(cond)) {                                                                             \
            ng_test_failures++;                                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

/* Run body once per CPU path this machine supports (baseline and the x86
 * ones up to the widest; baseline and neon on aarch64, where
 * ng_cpu_isa_set refuses the x86 ones). */
#define NG_FOR_EACH_ISA(isa_var)                                                                   \
    for (int isa_var = NG_ISA_BASELINE; isa_var <= (int)ng_cpu_isa_supported(); isa_var++)         \
        if (ng_cpu_isa_set((ng_cpu_isa)isa_var) == NG_OK)

static inline int ng_test_finish(const char *name) {
    printf("%s: %d checks, %d failed\n", name, ng_test_checks, ng_test_failures);
    return ng_test_failures ? 1 : 0;
}

#endif /* NG_TEST_H */
