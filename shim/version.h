/*
 * shim/version.h - the stable-ABI versions nanguard is written against.
 *
 * Kept apart from shim.h, and written as plain integer constants (no casts),
 * so that the C++ drift test can include it first and set PyTorch's
 * TORCH_TARGET_VERSION from it before any PyTorch header is read: PyTorch's
 * headers compare that macro in #if directives.
 */
#ifndef NG_SHIM_VERSION_H
#define NG_SHIM_VERSION_H

/* PyTorch's encoding: major in bits 56-63, minor in bits 48-55. */
#define NG_TORCH_VERSION(major, minor) (((0ULL + (major)) << 56) | ((0ULL + (minor)) << 48))
/* The stable-ABI version whose calling conventions nanguard's code follows,
 * and the oldest runtime it loads on. */
#define NG_TORCH_TARGET_VERSION NG_TORCH_VERSION(2, 11)

#endif /* NG_SHIM_VERSION_H */
