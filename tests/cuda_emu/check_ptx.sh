#!/bin/sh
# check_ptx.sh NVCC SOURCE INCLUDE_DIR [ATTENTION_CU...]: compiles SOURCE
# (tests/cuda_emu/ptx_check.cu) to PTX for sm_80 and sm_90 with warnings as
# errors, and fails unless every ldmatrix / cp.async form kernels/cuda_ptx.h
# wraps is in the output. With ATTENTION_CU (the kernels/attention_*.cu files
# of the tensor-core and decode kernels), also
# compiles them to PTX for sm_80, splits the PTX into its .entry blocks and
# fails unless every tensor-core kernel's own block (forward, dk / dv, dq,
# decode, in every instantiation) holds mma.sync and the ldmatrix and cp.async
# forms its pipeline uses (the build's sm_80 PTX of a file, kept by nvcc in
# NG_PTX_KEEP_DIR, is read instead of compiling it again),
# and every decode kernel's block holds cp.async.cg (its pipelined
# instantiations also commit_group and wait_group 0).
nvcc=$1 src=$2 inc=$3
shift 3
tmp=${TMPDIR:-/tmp}/ng_ptx_check.$$
trap 'rm -f "$tmp" "$tmp.1"' EXIT
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
[ $# -gt 0 ] || exit $status

attn="$*"
: >"$tmp"
for f in "$@"; do
    # the build's own sm_80 PTX of the file (nvcc -keep, NG_PTX_KEEP_DIR), if
    # it is newer than the source; else compiled here
    kept=${NG_PTX_KEEP_DIR:-/nonexistent}/$(basename "$f" .cu).compute_80.ptx
    if [ -f "$kept" ] && [ "$kept" -nt "$f" ]; then
        echo "check_ptx: $f: the build's sm_80 PTX, $kept"
        cat "$kept" >>"$tmp"
        continue
    fi
    if ! "$nvcc" -std=c++17 -arch=sm_80 -ptx -O3 --expt-relaxed-constexpr -I"$inc" "$f" -o "$tmp.1"; then
        echo "check_ptx: nvcc -arch=sm_80 -ptx $f failed"
        exit 1
    fi
    cat "$tmp.1" >>"$tmp"
done
# per .entry block of a tensor-core or decode kernel: its (mangled) name and
# how often the instruction occurs in it
per_entry() {
    awk -v want="$1" '
        /^[.a-z ]*\.(entry|func)[ \t]/ {
            cur = ""
            if ($0 ~ /\.entry[ \t]/ && $0 ~ /attention_((fwd|bwd_dkdv|bwd_dq|decode)_mma|decode)_kernel/) {
                cur = $0
                sub(/^.*\.entry[ \t]+/, "", cur)
                sub(/\(.*$/, "", cur)
                n[cur] = 0
            }
            next
        }
        cur != "" && index($0, want) { n[cur]++ }
        END { for (k in n) print n[k], k }' "$tmp"
}
# check_entries INSN KERNEL PATTERN: every sm_80 .entry of KERNEL whose
# mangled name matches PATTERN holds INSN, and there is at least one
check_entries() {
    entries=$(per_entry "$1" | grep -F "$2" | grep -E "$3")
    if [ -z "$entries" ]; then
        echo "check_ptx: no .entry of $2 matching $3 in the sm_80 PTX of $attn"
        status=1
        return
    fi
    echo "$entries" | while read -r n name; do
        echo "sm_80 $name: $n x $1"
    done
    if echo "$entries" | grep -q '^0 '; then
        echo "check_ptx: an sm_80 .entry of $2 lacks $1"
        status=1
    fi
}
for kernel in attention_fwd_mma_kernel attention_bwd_dkdv_mma_kernel attention_bwd_dq_mma_kernel \
    attention_decode_mma_kernel; do
    for insn in 'mma.sync.aligned.m16n8k16.row.col.f32' 'ldmatrix.sync.aligned.m8n8.x4.shared.b16' \
        'ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16' 'cp.async.cg.shared.global' \
        'cp.async.commit_group' 'cp.async.wait_group 0'; do
        check_entries "$insn" "$kernel" '.'
    done
done
# the decode kernel: 16-byte cp.async in every instantiation; the pipelined
# ones (template argument Pipe = true, mangled Lb1E) commit groups and wait
# for them
check_entries 'cp.async.cg.shared.global' attention_decode_kernel '.'
check_entries 'cp.async.commit_group' attention_decode_kernel 'Lb1E'
check_entries 'cp.async.wait_group 0' attention_decode_kernel 'Lb1E'
exit $status
