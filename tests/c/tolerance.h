/*
 * tests/c/tolerance.h - the element-wise tolerance of the attention and CUDA
 * tests: |got - ref| <= aabs + afrac * rowmax + rtol * |ref|, rowmax being
 * a scale of the row the element belongs to (its largest finite |ref|, or
 * what the caller passes; 0 where afrac is 0). `why` says where the limit
 * comes from and is printed with a mismatch.
 */
#ifndef NG_TEST_TOLERANCE_H
#define NG_TEST_TOLERANCE_H

#include <math.h>

typedef struct tol {
    double rtol, afrac, aabs;
    const char *why;
} tol;

static inline double tol_limit(tol t, double ref, double rowmax) {
    return t.aabs + t.afrac * rowmax + t.rtol * fabs(ref);
}

#endif /* NG_TEST_TOLERANCE_H */
