# Cross build for aarch64 Linux with Debian's gcc-aarch64-linux-gnu, tests
# run under qemu-user (scripts/aarch64.sh):
#
#   cmake -S . -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
#         -DNG_TORCH=OFF -DNG_CUDA=OFF
#
# ctest then runs each test binary through CMAKE_CROSSCOMPILING_EMULATOR,
# with the target's libc found under /usr/aarch64-linux-gnu.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
# The C kernels and tests/c only: tests/cuda_emu is host C++ that the
# emulator would run instruction by instruction.
set(NG_CUDA_EMU OFF CACHE BOOL "Build the CUDA emulator's tests (tests/cuda_emu)")

set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)

find_program(NG_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(NG_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${NG_QEMU_AARCH64} -L /usr/aarch64-linux-gnu)
endif()
