/*
 * tests/cuda_emu/include/cuda_runtime.h - what a .cu file sees when the CPU
 * emulator compiles it as host C++: the runtime API and the device side of
 * the CUDA execution model (tests/cuda_emu/cuda_emu.h).
 */
#ifndef NG_CUDA_EMU_RUNTIME_H
#define NG_CUDA_EMU_RUNTIME_H

#include "cuda_runtime_api.h"
#include "../cuda_emu.h"

#endif /* NG_CUDA_EMU_RUNTIME_H */
