#!/bin/sh
# check_ptx.sh NVCC SOURCE INCLUDE_DIR: compiles SOURCE (tests/cuda_emu/ptx_check.cu)
# to PTX for sm_80 and sm_90 with warnings as errors, and fails unless every
# ldmatrix / cp.async form kernels/cuda_ptx.h wraps is in the output.
nvcc=$1 src=$2 inc=$3
tmp=${TMPDIR:-/tmp}/ng_ptx_check.$$
trap 'rm -f "$tmp"' EXIT
status=0
for sm in 80 90; do
    if ! "$nvcc" -std=c++17 -arch=sm_$sm -ptx -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror \
        -I"$inc" "$src" -o "$tmp"; then
        echo "check_ptx: nvcc -arch=sm_$sm failed"
        exit 1
    fi
    for insn in \
        'ldmatrix.sync.aligned.m8n8.x1.shared.b16' 'ldmatrix.sync.aligned.m8n8.x2.shared.b16' \
        'ldmatrix.sync.aligned.m8n8.x4.shared.b16' 'ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16' \
        'ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16' 'ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16' \
        'cp.async.cg.shared.global' 'cp.async.ca.shared.global' 'cp.async.commit_group' \
        'cp.async.wait_group 1' 'cp.async.wait_group 0' 'cp.async.wait_all'; do
        n=$(grep -cF "$insn" "$tmp")
        echo "sm_$sm: $n x $insn"
        [ "$n" -gt 0 ] || { echo "check_ptx: sm_$sm PTX lacks $insn"; status=1; }
    done
done
exit $status
