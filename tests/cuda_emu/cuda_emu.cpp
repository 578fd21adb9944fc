/*
 * tests/cuda_emu/cuda_emu.cpp - the CPU emulator of the CUDA execution model:
 * device memory, launches, the fiber scheduler, warp intrinsics, mma.sync,
 * ldmatrix, cp.async and the runtime API calls nanguard's kernels and tests make. See cuda_emu.h
 * for the model and the limits it enforces.
 *
 * Scheduling: one host thread runs everything. A block's threads are fibers
 * (a hand-written x86-64 context switch, ucontext elsewhere); the scheduler
 * sweeps them in the schedule's order, and each runs until it waits at a
 * barrier or a warp intrinsic, or ends. A warp intrinsic completes the
 * moment the last lane of its mask arrives; a barrier when a sweep ends with
 * every thread of the block waiting on it. A sweep in which nothing can run
 * while threads still wait is a deadlock, reported with every thread's
 * position.
 *
 * Device memory: each cudaMalloc is an mmap of its own, the buffer placed at
 * the end of its readable pages (256-byte aligned, as cudaMalloc's are), with
 * 64 KiB of inaccessible pages before it and at least 1 MiB after, so an
 * access far out of bounds faults and is reported with the buffer it missed.
 * Under AddressSanitizer the few bytes between the buffer's end and the
 * guard (and before its start) are poisoned too. Fresh buffers hold 0xff
 * bytes.
 *
 * Two schedules per launch: device memory is snapshotted, the grid runs with
 * blocks in order, lanes in order and warps in lockstep, the result is kept,
 * memory is restored, the grid runs again with blocks shuffled, lanes
 * reversed and warps chosen at random (see `schedule`), and the two results
 * must be equal byte for byte. NG_EMU_SCHEDULES=1 runs the first only.
 */
#include "cuda_emu.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <deque>
#include <map>
#include <string>
#include <vector>

#if defined(NG_EMU_ASAN)
/* set by the build: the program runs under AddressSanitizer, this file is
 * not instrumented */
#elif defined(__SANITIZE_ADDRESS__)
#define NG_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NG_EMU_ASAN 1
#endif
#endif
#ifdef NG_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace ng_emu {

lane_view *g_cur;
uint3 g_block_idx;
dim3 g_block_dim, g_grid_dim;

namespace {

/* ---- errors ----------------------------------------------------------------- */

cudaError_t g_last = cudaSuccess;   /* what cudaGetLastError returns and clears */
cudaError_t g_sticky = cudaSuccess; /* a kernel fault: every later call fails */

cudaError_t fail(cudaError_t e) {
    g_last = e;
    return e;
}

__attribute__((format(printf, 1, 2))) void say(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("cuda_emu: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
}

/* ---- the device the emulator imitates -------------------------------------- */

struct arch {
    int sm, optin_smem, sms;
};
const arch kArchs[] = {
    {75, 64 * 1024, 40},  {80, 163 * 1024, 108}, {86, 99 * 1024, 84},
    {89, 99 * 1024, 128}, {90, 227 * 1024, 132},
};
const arch *g_arch;

const arch *find_arch(int sm) {
    for (const arch &a : kArchs)
        if (a.sm == sm) return &a;
    return nullptr;
}

const arch &device() {
    if (!g_arch) {
        const char *env = getenv("NG_EMU_SM");
        g_arch = find_arch(env ? atoi(env) : 90);
        if (!g_arch) {
            say("NG_EMU_SM=%s is not an sm the emulator knows (75, 80, 86, 89, 90); using 90", env);
            g_arch = find_arch(90);
        }
    }
    return *g_arch;
}

/* ---- device memory ---------------------------------------------------------- */

constexpr size_t kPage = 4096, kPre = 64 * 1024, kMinPost = 1024 * 1024;

struct alloc {
    char *map; /* the whole mapping, guards included */
    size_t map_len;
    char *rw;      /* first readable byte */
    size_t rw_len; /* readable bytes */
    char *ptr;     /* the buffer handed out */
    size_t size;   /* its size as requested */
};
std::map<uintptr_t, alloc> g_allocs; /* by ptr */

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

void asan_poison(const void *p, size_t n) {
#ifdef NG_EMU_ASAN
    if (n) __asan_poison_memory_region(p, n);
#else
    (void)p, (void)n;
#endif
}
void asan_unpoison(const void *p, size_t n) {
#ifdef NG_EMU_ASAN
    if (n) __asan_unpoison_memory_region(p, n);
#else
    (void)p, (void)n;
#endif
}

/* The buffer holding [p, p + n), or null. */
alloc *find_alloc(const void *p, size_t n) {
    const uintptr_t a = (uintptr_t)p;
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin()) return nullptr;
    --it;
    alloc &b = it->second;
    if (a < (uintptr_t)b.ptr || a + n > (uintptr_t)b.ptr + b.size || a + n < a) return nullptr;
    return &b;
}

/* The buffer whose mapping (guards included) holds p, or null. */
const alloc *find_mapping(uintptr_t p) {
    for (auto &kv : g_allocs)
        if (p >= (uintptr_t)kv.second.map && p < (uintptr_t)kv.second.map + kv.second.map_len)
            return &kv.second;
    return nullptr;
}

/* ---- fibers ----------------------------------------------------------------- */

enum tstate { T_RUN, T_BAR, T_WARP, T_DONE };

/* Which warp runs on when the running one stops (all its lanes wait at a
 * barrier or a warp intrinsic, or have exited, or its lanes were all run
 * once): LOCKSTEP the next warp of a sweep over the block (so every warp
 * advances one warp intrinsic per sweep); SERIAL the same warp again while it
 * has a runnable lane (it runs on to the next __syncthreads or its end);
 * RANDOM any warp with a runnable lane, drawn from the schedule's seeded
 * generator, or the same warp again with a probability drawn per block (1:
 * serial, 7/8, or 0: drawn afresh at every stop), so that warps drift apart
 * by a few intrinsics or by all of them between two barriers. */
enum warp_policy { P_LOCKSTEP, P_SERIAL, P_RANDOM };

/* A cp.async copy a thread has issued and not yet retired: its source bytes
 * (read at issue) and the commit group it belongs to (-1: not committed). */
struct cp_copy {
    char *dst;
    uint32_t words[4];
    int bytes;
    long long group;
    const char *site;
};

struct thread_state {
    lane_view v; /* first: g_cur points here */
    void *sp;
    char *stack;
    int linear, lane, warp;
    tstate state;
    const char *site;
    /* a posted warp intrinsic */
    warp_kind kind;
    unsigned mask;
    uint64_t value, result;
    int arg, width;
    float *mma_c;
    const uint32_t *mma_a, *mma_b;
    int mma_bf16;
    /* a posted ldmatrix: the form, this lane's row (when the form uses it)
     * and where its registers go */
    int ld_num, ld_trans;
    uint32_t ld_row[4];
    uint32_t *ld_out;
    /* cp.async: the copies in issue order, and the groups committed so far */
    std::deque<cp_copy> cp_queue;
    long long cp_groups;
#ifdef NG_EMU_ASAN
    void *fake_stack;
#endif
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
};

constexpr size_t kStack = 256 * 1024, kStackGuard = kPage;
std::vector<char *> g_stacks;    /* one per thread slot, allocated on demand */
std::vector<char> g_stack_dirty; /* per slot: a fiber was abandoned on it mid-kernel */
std::vector<thread_state> g_threads;
thread_state *g_running; /* the fiber now running, or null */
void *g_sched_sp;        /* the scheduler's saved stack pointer */
#if !defined(__x86_64__)
ucontext_t g_sched_uc;
#endif
#ifdef NG_EMU_ASAN
void *g_sched_fake_stack;
const void *g_sched_bottom;
size_t g_sched_size;
#endif

/* The current launch, for messages. */
struct launch_info {
    std::string name;
    kernel_body *body;
    char *dyn;
    size_t dyn_size;
    int nthreads, nwarps;
    int live, at_barrier, exited;
    int schedule;                   /* 0: the first schedule, 1: the second */
    int reverse;                    /* lanes (and, in lockstep, warps) in reverse order */
    warp_policy policy;             /* which warp runs when one stops */
    int cur_warp, cur_lane;         /* the warp running and its last lane run; -1: none */
    uint64_t rng;                   /* the schedule's generator (xorshift64) */
    int stay;                       /* RANDOM: stay on the running warp with probability stay / 8 */
    std::vector<unsigned> runnable; /* per warp: lanes in state T_RUN */
    std::vector<unsigned> waiting;  /* per warp: lanes waiting at a warp intrinsic */
    std::vector<unsigned> gone;     /* per warp: lanes that exited */
    std::vector<unsigned> present;  /* per warp: lanes the block has */
    unsigned char poison;           /* the byte shared memory holds at a block's start */
    bool fault;
    bool active;
} g_launch;

} // namespace
} // namespace ng_emu

#if defined(__x86_64__)
/* ng_emu_swap(&save_sp, new_sp): push the callee-saved registers, switch
 * stacks, pop the other side's. The SSE / x87 control words are not
 * switched: no kernel changes rounding modes. */
extern "C" void ng_emu_swap(void **save_sp, void *new_sp);
asm(R"(
    .text
    .globl ng_emu_swap
    .type ng_emu_swap, @function
ng_emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ng_emu_swap, .-ng_emu_swap
)");
#endif

namespace ng_emu {
namespace {

void fiber_entry();
void rc_flush();
__attribute__((format(printf, 2, 3))) void fault(thread_state *t, const char *fmt, ...);
#if !defined(__x86_64__)
void fiber_entry_uc() { fiber_entry(); }
#endif

char *stack_for(int i) {
    while ((int)g_stacks.size() <= i) {
        void *m = mmap(nullptr, kStack + kStackGuard, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            say("cannot map a %zu-byte fiber stack: %s", kStack, strerror(errno));
            abort();
        }
        mprotect(m, kStackGuard, PROT_NONE); /* overflow faults */
        g_stacks.push_back((char *)m + kStackGuard);
        g_stack_dirty.push_back(0);
    }
    return g_stacks[i];
}

void init_fiber(thread_state *t) {
    t->stack = stack_for(t->linear);
    /* A fiber abandoned mid-kernel (a fault) leaves its frames' poison; one
     * that returned has unpoisoned them itself. */
    if (g_stack_dirty[t->linear]) {
        asan_unpoison(t->stack, kStack);
        g_stack_dirty[t->linear] = 0;
    }
#if defined(__x86_64__)
    /* Stacks are kStack apart, so their tops would all fall in the same
     * cache sets; start each at its own offset within a page. */
    uint64_t *sp = (uint64_t *)(t->stack + kStack - (size_t)(t->linear * 192 % 4096));
    *--sp = 0;                                 /* where a caller's return address would be */
    *--sp = (uint64_t)(uintptr_t)&fiber_entry; /* ng_emu_swap returns here */
    for (int r = 0; r < 6; r++) *--sp = 0;     /* rbp rbx r12-r15 */
    t->sp = sp;
#else
    getcontext(&t->uc);
    t->uc.uc_stack.ss_sp = t->stack;
    t->uc.uc_stack.ss_size = kStack;
    t->uc.uc_link = nullptr;
    makecontext(&t->uc, fiber_entry_uc, 0);
#endif
#ifdef NG_EMU_ASAN
    t->fake_stack = nullptr;
#endif
}

/* Switch from the stack of `from` (null: the scheduler) to fiber `to` (null:
 * the scheduler). `dying`: `from` never runs again. */
void switch_to(thread_state *from, thread_state *to, bool dying) {
    void **save = from ? &from->sp : &g_sched_sp;
#ifdef NG_EMU_ASAN
    void **fake = dying ? nullptr : from ? &from->fake_stack : &g_sched_fake_stack;
    __sanitizer_start_switch_fiber(fake, to ? (const void *)to->stack : g_sched_bottom,
                                   to ? kStack : g_sched_size);
#else
    (void)dying;
#endif
    g_running = to;
    g_cur = to ? &to->v : nullptr;
#if defined(__x86_64__)
    ng_emu_swap(save, to ? to->sp : g_sched_sp);
#else
    (void)save;
    swapcontext(from ? &from->uc : &g_sched_uc, to ? &to->uc : &g_sched_uc);
#endif
#ifdef NG_EMU_ASAN
    __sanitizer_finish_switch_fiber(from ? from->fake_stack : g_sched_fake_stack, nullptr, nullptr);
#endif
    g_running = from;
    g_cur = from ? &from->v : nullptr;
}

void set_state(thread_state *t, tstate s) {
    t->state = s;
    if (s == T_RUN)
        g_launch.runnable[t->warp] |= 1u << t->lane;
    else
        g_launch.runnable[t->warp] &= ~(1u << t->lane);
}

uint64_t next_random() {
    uint64_t &s = g_launch.rng;
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return s;
}

/* The first runnable lane of `lanes` in the schedule's lane order. */
int first_lane(unsigned lanes) {
    return g_launch.reverse ? 31 - __builtin_clz(lanes) : __builtin_ctz(lanes);
}

/* The next thread to run, or null: the sweep is over (LOCKSTEP) or no thread
 * can run. Within a warp, lanes run in the schedule's order, each until it
 * waits or ends; when the warp has no runnable lane left after the last one
 * run, the policy picks the next warp. */
thread_state *next_in_sweep() {
    const int nw = g_launch.nwarps;
    int w = g_launch.cur_warp;
    if (w >= 0) {
        const unsigned m = g_launch.runnable[w], l = (unsigned)g_launch.cur_lane;
        const unsigned after = g_launch.reverse ? m & ((1u << l) - 1u)
                               : l == 31        ? 0u
                                                : m & (0xffffffffu << (l + 1));
        if (after) {
            g_launch.cur_lane = first_lane(after);
            return &g_threads[w * 32 + g_launch.cur_lane];
        }
    }
    switch (g_launch.policy) {
    case P_LOCKSTEP: {
        /* warps in order (reversed: from the last), each once per sweep */
        int k = w < 0 ? 0 : (g_launch.reverse ? nw - 1 - w : w) + 1;
        for (w = -1; k < nw; k++) {
            const int c = g_launch.reverse ? nw - 1 - k : k;
            if (g_launch.runnable[c]) {
                w = c;
                break;
            }
        }
        break;
    }
    case P_SERIAL:
        if (w < 0 || !g_launch.runnable[w]) {
            int k = w < 0 ? 0 : 1;
            const int start = w < 0 ? 0 : (g_launch.reverse ? nw - 1 - w : w);
            for (w = -1; k <= nw; k++) {
                const int c0 = (start + k) % nw, c = g_launch.reverse ? nw - 1 - c0 : c0;
                if (g_launch.runnable[c]) {
                    w = c;
                    break;
                }
            }
        }
        break;
    case P_RANDOM: {
        /* stay on the running warp with the block's probability, else draw */
        if (w >= 0 && g_launch.runnable[w] && g_launch.stay > 0 &&
            (g_launch.stay >= 8 || (int)(next_random() % 8) < g_launch.stay))
            break;
        int cand[32], nc = 0;
        for (int c = 0; c < nw; c++)
            if (g_launch.runnable[c]) cand[nc++] = c;
        w = nc ? cand[next_random() % (uint64_t)nc] : -1;
        break;
    }
    }
    g_launch.cur_warp = w;
    if (w < 0) return nullptr;
    g_launch.cur_lane = first_lane(g_launch.runnable[w]);
    return &g_threads[w * 32 + g_launch.cur_lane];
}

/* A fiber stops (it waits or ends): the next runnable thread of the sweep
 * runs on, or the scheduler when the sweep is over or a fault stopped it. */
void leave(thread_state *t, bool dying) {
    thread_state *next = g_launch.fault ? nullptr : next_in_sweep();
    switch_to(t, next, dying);
}

void fiber_entry() {
#ifdef NG_EMU_ASAN
    const void *from_bottom;
    size_t from_size;
    __sanitizer_finish_switch_fiber(nullptr, &from_bottom, &from_size);
    if (!g_sched_bottom) { /* the first fiber ever is started by the scheduler: that is its stack */
        g_sched_bottom = from_bottom;
        g_sched_size = from_size;
    }
#endif
    thread_state *t = g_running;
    g_launch.body->run();
    rc_flush();
    if (!t->cp_queue.empty()) {
        const cp_copy &c = t->cp_queue.back();
        int uncommitted = 0;
        for (const cp_copy &q : t->cp_queue) uncommitted += q.group < 0;
        fault(t,
              "the thread ends with %zu cp.async copies it never waited for (%d of them never "
              "committed); the last issued at %s: a cp.async.commit_group / wait_group (or "
              "wait_all) is missing, and the copies' data never reached shared memory",
              t->cp_queue.size(), uncommitted, c.site);
    }
    set_state(t, T_DONE);
    g_launch.live--;
    g_launch.exited++;
    g_launch.gone[t->warp] |= 1u << t->lane;
    leave(t, true);
    __builtin_unreachable();
}

const char *kind_name(warp_kind k) {
    switch (k) {
    case W_SHFL_IDX: return "__shfl_sync";
    case W_SHFL_UP: return "__shfl_up_sync";
    case W_SHFL_DOWN: return "__shfl_down_sync";
    case W_SHFL_XOR: return "__shfl_xor_sync";
    case W_BALLOT: return "__ballot_sync";
    case W_ANY: return "__any_sync";
    case W_ALL: return "__all_sync";
    case W_SYNCWARP: return "__syncwarp";
    case W_MMA: return "mma.sync.m16n8k16";
    case W_LDMATRIX: return "ldmatrix.sync.m8n8";
    }
    return "?";
}

/* A fault inside the kernel: say where, abandon the launch. Called on a
 * fiber (t set) or by the scheduler (t null). */
__attribute__((format(printf, 2, 3))) void fault(thread_state *t, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (t)
        say("%s: block (%u, %u, %u), thread (%u, %u, %u): %s", g_launch.name.c_str(), g_block_idx.x,
            g_block_idx.y, g_block_idx.z, t->v.idx.x, t->v.idx.y, t->v.idx.z, msg);
    else
        say("%s: block (%u, %u, %u): %s", g_launch.name.c_str(), g_block_idx.x, g_block_idx.y,
            g_block_idx.z, msg);
    g_launch.fault = true;
    for (int i = 0; i < g_launch.nthreads && i < (int)g_stack_dirty.size(); i++)
        g_stack_dirty[i] = 1;
    if (t) {
        set_state(t, T_DONE);
        switch_to(t, nullptr, true);
        __builtin_unreachable();
    }
}

const char *state_name(const thread_state &t) {
    switch (t.state) {
    case T_RUN: return "runnable";
    case T_BAR: return "__syncthreads";
    case T_WARP: return kind_name(t.kind);
    case T_DONE: return "exited";
    }
    return "?";
}

/* Every thread's position, for a deadlock report (runs of equal lines folded). */
std::string positions() {
    std::string out;
    const int n = g_launch.nthreads;
    for (int i = 0; i < n;) {
        const thread_state &t = g_threads[i];
        int j = i + 1;
        while (j < n && g_threads[j].state == t.state && g_threads[j].site == t.site &&
               (t.state != T_WARP || (g_threads[j].kind == t.kind && g_threads[j].mask == t.mask)))
            j++;
        char line[320];
        if (t.state == T_WARP)
            snprintf(line, sizeof line, "\n    threads %d..%d: %s (mask 0x%08x) at %s", i, j - 1,
                     state_name(t), t.mask, t.site);
        else if (t.state == T_BAR)
            snprintf(line, sizeof line, "\n    threads %d..%d: __syncthreads at %s", i, j - 1,
                     t.site);
        else
            snprintf(line, sizeof line, "\n    threads %d..%d: %s", i, j - 1, state_name(t));
        out += line;
        i = j;
    }
    return out;
}

/* ---- warp intrinsics ------------------------------------------------------- */

float half_to_f32(uint16_t h, int bf16) { return bf16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h); }

/* D = A B + C of one warp, from the PTX ISA's fragment layout of
 * mma.m16n8k16 with 16-bit A / B and fp32 C / D (lane = 4 g + t):
 *   A a0..a7 (registers a[i / 2], low half first): row g + 8 ((i / 2) & 1), col 2t + (i & 1) + 8 (i >= 4)
 *   B b0..b3 (registers b[i / 2]): row (k) 2t + (i & 1) + 8 (i >= 2), col (n) g
 *   C c0..c3: row g + 8 (i >= 2), col 2t + (i & 1)
 * Products of 16-bit values are exact; the 16 of a dot product and C are
 * summed in fp64 and rounded once to fp32. (The tensor cores' own order and
 * rounding of that sum are not IEEE and differ in the last bits.) */
void mma_resolve(thread_state *w) {
    double A[16][16], B[16][8], C[16][8];
    const int bf16 = w[0].mma_bf16;
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        const thread_state &u = w[l];
        for (int i = 0; i < 8; i++) {
            const uint16_t h = (uint16_t)(u.mma_a[i >> 1] >> (16 * (i & 1)));
            A[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >= 4)] = half_to_f32(h, bf16);
        }
        for (int i = 0; i < 4; i++) {
            const uint16_t h = (uint16_t)(u.mma_b[i >> 1] >> (16 * (i & 1)));
            B[2 * t + (i & 1) + 8 * (i >= 2)][g] = half_to_f32(h, bf16);
        }
        for (int i = 0; i < 4; i++) C[g + 8 * (i >= 2)][2 * t + (i & 1)] = u.mma_c[i];
    }
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; i++) {
            const int r = g + 8 * (i >= 2), n = 2 * t + (i & 1);
            double s = C[r][n];
            for (int k = 0; k < 16; k++) s += A[r][k] * B[k][n];
            w[l].mma_c[i] = (float)s;
        }
    }
}

/* ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 of one warp, from
 * the PTX ISA's "ldmatrix" section and its fragment figure: lane 8 m + r
 * gave row r of matrix m (its 8 elements in ld_row, element c in the half
 * c & 1 of word c / 2); register m of lane l = 4 g + t receives elements
 * (g, 2t), (g, 2t + 1) of matrix m, or with .trans (2t, g), (2t + 1, g), the
 * first in the low half. */
void ldmatrix_resolve(thread_state *w) {
    const int num = w[0].ld_num, trans = w[0].ld_trans;
    auto elem = [w](int m, int r, int c) -> uint32_t {
        return (w[8 * m + r].ld_row[c >> 1] >> (16 * (c & 1))) & 0xffffu;
    };
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        for (int m = 0; m < num; m++) {
            const uint32_t lo = trans ? elem(m, 2 * t, g) : elem(m, g, 2 * t),
                           hi = trans ? elem(m, 2 * t + 1, g) : elem(m, g, 2 * t + 1);
            w[l].ld_out[m] = lo | hi << 16;
        }
    }
}

/* If every lane of t's mask waits at a warp intrinsic, complete it. */
void try_resolve(thread_state *t) {
    const unsigned mask = t->mask;
    const int base = t->warp * 32;
    thread_state *w = &g_threads[base];
    if (unsigned missing = mask & ~g_launch.present[t->warp])
        fault(t,
              "%s at %s: mask 0x%08x names lane %d, which this block of %d threads does not have",
              kind_name(t->kind), t->site, mask, __builtin_ctz(missing), g_launch.nthreads);
    if (unsigned gone = mask & g_launch.gone[t->warp])
        fault(t, "%s at %s: mask 0x%08x names lane %d, which has exited", kind_name(t->kind),
              t->site, mask, __builtin_ctz(gone));
    if ((g_launch.waiting[t->warp] & mask) != mask) return; /* not all there yet */
    for (unsigned m = mask; m; m &= m - 1) {
        const int l = __builtin_ctz(m);
        const thread_state &u = w[l];
        if (u.kind != t->kind || u.mask != mask || u.width != t->width ||
            (t->kind == W_MMA && u.mma_bf16 != t->mma_bf16) ||
            (t->kind == W_LDMATRIX && (u.ld_num != t->ld_num || u.ld_trans != t->ld_trans)))
            fault(
                t,
                "lanes of one mask at different warp intrinsics: lane %d at %s (%s, mask 0x%08x), lane %d at %s "
                "(%s, mask 0x%08x)",
                t->lane, t->site, kind_name(t->kind), mask, l, u.site, kind_name(u.kind), u.mask);
    }
    switch (t->kind) {
    case W_MMA:
        if (mask != 0xffffffffu)
            fault(t, "mma.sync at %s needs all 32 lanes, mask 0x%08x", t->site, mask);
        mma_resolve(w);
        break;
    case W_LDMATRIX: ldmatrix_resolve(w); break;
    case W_BALLOT:
    case W_ANY:
    case W_ALL: {
        unsigned bits = 0;
        for (int l = 0; l < 32; l++)
            if ((mask >> l & 1u) && w[l].value) bits |= 1u << l;
        const uint64_t r = t->kind == W_BALLOT ? bits : t->kind == W_ANY ? bits != 0 : bits == mask;
        for (int l = 0; l < 32; l++)
            if (mask >> l & 1u) w[l].result = r;
        break;
    }
    case W_SYNCWARP: break;
    default: {
        for (unsigned m = mask; m; m &= m - 1) {
            const int l = __builtin_ctz(m);
            thread_state &u = w[l];
            const int width = u.width, seg = l & ~(width - 1);
            int src = l;
            switch (u.kind) {
            case W_SHFL_IDX: src = seg + (u.arg & (width - 1)); break;
            case W_SHFL_UP: src = l - u.arg >= seg ? l - u.arg : l; break;
            case W_SHFL_DOWN: src = l + u.arg < seg + width ? l + u.arg : l; break;
            case W_SHFL_XOR: src = (l ^ u.arg) < seg + width ? (l ^ u.arg) : l; break;
            default: break;
            }
            if (src < 0 || src > 31 || !(mask >> src & 1u))
                fault(
                    t,
                    "%s at %s: lane %d reads lane %d, which is not in the mask 0x%08x (undefined on a GPU)",
                    kind_name(u.kind), u.site, l, src, mask);
            u.result = w[src].value;
        }
    }
    }
    for (unsigned m = mask; m; m &= m - 1) set_state(&w[__builtin_ctz(m)], T_RUN);
    g_launch.waiting[t->warp] &= ~mask;
}

thread_state *running(const char *what) {
    if (!g_running) {
        say("%s called outside an emulated kernel", what);
        abort();
    }
    return g_running;
}

uint64_t post(thread_state *t) {
    if (!(t->mask >> t->lane & 1u))
        fault(t, "%s at %s: lane %d calls it with mask 0x%08x, which does not include it",
              kind_name(t->kind), t->site, t->lane, t->mask);
    set_state(t, T_WARP);
    g_launch.waiting[t->warp] |= 1u << t->lane;
    try_resolve(t);
    if (t->state == T_WARP) leave(t, false);
    return t->result;
}

/* ---- signals ------------------------------------------------------------------- */

struct sigaction g_old_segv, g_old_bus;

void on_fault(int sig, siginfo_t *si, void *uc) {
    const uintptr_t a = (uintptr_t)si->si_addr;
    char where[512] = "";
    if (const alloc *b = find_mapping(a)) {
        if (a >= (uintptr_t)b->ptr + b->size)
            snprintf(where, sizeof where, "%zu bytes past the end of a device buffer of %zu bytes",
                     (size_t)(a - ((uintptr_t)b->ptr + b->size)), b->size);
        else
            snprintf(where, sizeof where,
                     "%zu bytes before the start of a device buffer of %zu bytes",
                     (size_t)((uintptr_t)b->ptr - a), b->size);
    } else {
        for (size_t i = 0; i < g_stacks.size(); i++)
            if (a >= (uintptr_t)(g_stacks[i] - kStackGuard) && a < (uintptr_t)g_stacks[i])
                snprintf(where, sizeof where,
                         "the guard page of emulated thread %zu's stack (stack overflow)", i);
        if (!where[0]) snprintf(where, sizeof where, "not in any device buffer");
    }
    if (g_launch.active && g_running) {
        const thread_state *t = g_running;
        say("%s: block (%u, %u, %u), thread (%u, %u, %u): invalid access to address 0x%lx: %s",
            g_launch.name.c_str(), g_block_idx.x, g_block_idx.y, g_block_idx.z, t->v.idx.x,
            t->v.idx.y, t->v.idx.z, (unsigned long)a, where);
    } else {
        say("invalid access to address 0x%lx outside any kernel: %s", (unsigned long)a, where);
    }
    const struct sigaction &old = sig == SIGSEGV ? g_old_segv : g_old_bus;
    if ((old.sa_flags & SA_SIGINFO) && old.sa_sigaction) {
        old.sa_sigaction(sig, si, uc); /* e.g. AddressSanitizer's report */
        return;
    }
    signal(sig, SIG_DFL); /* the access repeats and ends the process */
}

void install_handlers() {
    static bool done = false;
    if (done) return;
    done = true;
    static char altstack[64 * 1024];
    stack_t ss = {};
    ss.ss_sp = altstack;
    ss.ss_size = sizeof altstack;
    sigaltstack(&ss, nullptr);
    struct sigaction sa = {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
}

/* ---- launches ------------------------------------------------------------------ */

std::map<const void *, int> g_max_dyn_smem;  /* cudaFuncSetAttribute */
std::map<std::string, cudaError_t> g_inject; /* ng_emu_inject */

std::map<std::string, long long> g_calls; /* ng_emu_calls */
int g_driver_version = CUDART_VERSION;

/* An injected failure for `call`, once, or cudaSuccess; counts the call. */
cudaError_t injected(const char *call) {
    g_calls[call]++;
    auto it = g_inject.find(call);
    if (it == g_inject.end()) return cudaSuccess;
    const cudaError_t e = it->second;
    g_inject.erase(it);
    return fail(e);
}

/* "kernel<T, N> [with ng_dtype T = NG_F16; int N = 64]": the launch's text
 * and the template arguments of the launcher it is in (from gcc's
 * __PRETTY_FUNCTION__, without the typedef notes "X = Y" it adds). */
std::string display_name(const char *kernel, const char *where) {
    std::string k = kernel;
    if (k.size() >= 2 && k.front() == '(' && k.back() == ')') k = k.substr(1, k.size() - 2);
    const char *w = strstr(where, "[with ");
    if (!w) return k;
    std::string args(w + 6), kept;
    if (!args.empty() && args.back() == ']') args.pop_back();
    for (size_t at = 0; at <= args.size();) {
        size_t end = args.find("; ", at);
        if (end == std::string::npos) end = args.size();
        const std::string part = args.substr(at, end - at), lhs = part.substr(0, part.find(" = "));
        if (lhs.find(' ') != std::string::npos)
            kept += (kept.empty() ? "" : "; ") + part; /* "type name = value" */
        at = end + 2;
    }
    return kept.empty() ? k : k + " [with " + kept + "]";
}

/* ---- schedules ----------------------------------------------------------------- */

/* The two schedules of every launch. The first: blocks in order, lanes in
 * order, warps in lockstep, shared memory poisoned with 0xff bytes (NaN in
 * every float type; the identity of an unsigned min). The second: blocks
 * shuffled, lanes reversed, the warp to run on drawn at random whenever one
 * stops (NG_EMU_WARPS=serial or lockstep chooses another policy), shared
 * memory poisoned with 0x00 bytes (zero; the identity of a sum or an unsigned
 * max). Its generator is seeded by NG_EMU_SEED (default 1) and the launch's
 * number in the process, so a run with the same seed and the same case
 * filter repeats it exactly. */
struct schedule {
    bool shuffled;
    int reverse;
    warp_policy policy;
    unsigned char poison;
};
const char *policy_name(warp_policy p) {
    return p == P_LOCKSTEP ? "lockstep" : p == P_SERIAL ? "serial" : "random";
}
warp_policy second_policy() {
    static int p = -1;
    if (p < 0) {
        const char *e = getenv("NG_EMU_WARPS");
        p = !e || !*e || !strcmp(e, "random") ? P_RANDOM
            : !strcmp(e, "serial")            ? P_SERIAL
            : !strcmp(e, "lockstep")          ? P_LOCKSTEP
                                              : -2;
        if (p == -2) {
            say("NG_EMU_WARPS=%s is not lockstep, serial or random; using random", e);
            p = P_RANDOM;
        }
    }
    return (warp_policy)p;
}
unsigned long long g_seed_env() {
    static unsigned long long seed = 0;
    static bool read = false;
    if (!read) {
        read = true;
        const char *e = getenv("NG_EMU_SEED");
        seed = e && *e ? strtoull(e, nullptr, 0) : 1ull;
    }
    return seed;
}
schedule the_schedule(int which) {
    if (which == 0) return schedule{false, 0, P_LOCKSTEP, 0xff};
    return schedule{true, 1, second_policy(), 0x00};
}
long long g_launches;

/* How many of the two schedules each launch runs: 2, or 1 (the first only)
 * with NG_EMU_SCHEDULES=1. The sanitizer build's sample runs one: races and
 * reads of unwritten memory are the normal build's to find (both schedules
 * and the race detector), AddressSanitizer's errors show in either. */
int schedules() {
    static const int n = [] {
        const char *e = getenv("NG_EMU_SCHEDULES");
        return e && strcmp(e, "1") == 0 ? 1 : 2;
    }();
    return n;
}

/* "NG_EMU_SEED=1, launch 7: blocks shuffled, lanes reversed, warps random,
 * shared memory 0x00" */
std::string schedule_text(int which) {
    const schedule sc = the_schedule(which);
    char buf[256];
    if (which == 0)
        snprintf(
            buf, sizeof buf,
            "the first schedule (blocks in order, lanes in order, warps lockstep, shared memory 0xff)");
    else
        snprintf(
            buf, sizeof buf,
            "the second schedule (blocks shuffled, lanes reversed, warps %s, shared memory 0x%02x; "
            "NG_EMU_SEED=%llu, launch %lld of the process)",
            policy_name(sc.policy), sc.poison, g_seed_env(), g_launches + 1);
    return buf;
}

/* ---- static shared memory (NG_SHARED) -------------------------------------------- */

/* Every NG_SHARED variable of every kernel has its own place in this arena,
 * given the first time its declaration runs; the used part is poisoned
 * before every block, as dynamic shared memory is. */
constexpr size_t kStaticSmem = 64 * 1024;
alignas(256) char g_static_smem[kStaticSmem];
size_t g_static_used;

struct smem_var {
    size_t off, size;
    const char *name, *site;
};
std::vector<smem_var> g_static_vars; /* for the race detector's messages */

void poison_shared() {
    memset(g_static_smem, g_launch.poison, g_static_used);
    if (g_launch.dyn_size) memset(g_launch.dyn, g_launch.poison, g_launch.dyn_size);
}

/* ---- the shared-memory race detector ------------------------------------------- */

/* With the kernels compiled with -fsanitize=thread (NG_EMU_RACECHECK: the
 * compiler then calls __tsan_read4(p), __tsan_write8(p), ... before every
 * load and store of memory that may be shared; no ThreadSanitizer runtime is
 * linked, the functions below are those calls' only definition), every access
 * of a block's shared memory is checked against the shadow of its bytes: the
 * last write and up to two reads of the current barrier epoch (two of
 * different warps, so that any read by another warp is remembered), each with
 * the thread and the code address. An access by a thread of another warp in
 * the same epoch (no __syncthreads between them) that is not read after read
 * is a hazard, as compute-sanitizer's racecheck reports one; so is a read of a
 * byte no thread of the block has written. A store that leaves a byte as it
 * was (a flag set to 1 by many threads, or cleared when it is already 0) is
 * no write to the hazard check: whatever the order, every thread reads the
 * same value. (The hook runs before the store, so a store is checked when its
 * thread next reaches the detector, a barrier, a warp intrinsic or its end,
 * before any other thread runs.) Threads of one warp are not checked against
 * each other. Epochs are numbered through the whole process (a new one at
 * each block's start and each barrier), so nothing is reset. */
struct shadow_acc {
    uint32_t epoch; /* 0: none */
    uint16_t tid;
    int32_t pc; /* code address, relative to rc_base() */
};
struct shadow {
    shadow_acc w, r, r2;
    uint32_t init; /* the epoch of the last store, changing the byte or not */
};
std::vector<shadow> g_shadow_static(kStaticSmem), g_shadow_dyn;
uint32_t g_epoch = 1, g_block_epoch = 1; /* the current epoch; the block's first */
bool g_racecheck_seen;                   /* some instrumented access reached the detector */
bool g_racecheck_off;                    /* NG_EMU_RACECHECK=0: the detector ignores every access */
long long g_races_checked;               /* shared-memory accesses checked */

uintptr_t rc_base() { return (uintptr_t)&poison_shared; }

void new_epoch(bool block_start) {
    if (++g_epoch >= 0xfffffff0u) { /* 4 billion barriers: start over */
        for (shadow &x : g_shadow_static) x = shadow{};
        for (shadow &x : g_shadow_dyn) x = shadow{};
        g_epoch = 1;
    }
    if (block_start) g_block_epoch = g_epoch;
}

/* "layernorm.cu:47 block_sum <- ln_bwd_dx_kernel" from addr2line, or the address. */
std::string pc_site(int32_t rel) {
    const uintptr_t pc = rc_base() + (intptr_t)rel;
    char out[1024];
    snprintf(out, sizeof out, "code address %p", (void *)pc);
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return out;
    exe[n] = 0;
    /* the executable's load address: where its ELF header is mapped */
    uintptr_t base = 0;
    if (FILE *m = fopen("/proc/self/maps", "r")) {
        char line[4608];
        while (fgets(line, sizeof line, m)) {
            unsigned long lo, off;
            char path[4096] = "";
            if (sscanf(line, "%lx-%*s %*s %lx %*s %*s %4095s", &lo, &off, path) == 3 && off == 0 &&
                strcmp(path, exe) == 0) {
                base = lo;
                break;
            }
        }
        fclose(m);
    }
    unsigned char hdr[18] = {0};
    if (FILE *f = fopen(exe, "rb")) {
        if (fread(hdr, 1, sizeof hdr, f) != sizeof hdr) hdr[16] = 0;
        fclose(f);
    }
    const uintptr_t addr = hdr[16] == 3 ? pc - base : pc; /* ET_DYN (PIE): relative */
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "addr2line -C -f -i -e '%s' 0x%lx 2>/dev/null", exe,
             (unsigned long)(addr - 1));
    FILE *p = popen(cmd, "r");
    if (!p) return out;
    std::string fn, site, text;
    char line[1024];
    for (int i = 0; fgets(line, sizeof line, p); i++) {
        line[strcspn(line, "\n")] = 0;
        if (char *d = strstr(line, " (discriminator")) *d = 0;
        if (i % 2 == 0) {
            fn = line;
        } else {
            const char *slash = strrchr(line, '/');
            if (!text.empty()) text += " <- ";
            text += std::string(slash ? slash + 1 : line) + " " + fn;
        }
    }
    pclose(p);
    if (text.empty() || text.compare(0, 2, "??") == 0) return out;
    return text;
}

/* "static shared memory red (layernorm.cu:123) byte 8" or "dynamic shared memory byte 520" */
std::string smem_place(bool dyn, size_t off) {
    char buf[512];
    if (dyn) {
        snprintf(buf, sizeof buf, "dynamic shared memory, byte %zu of %zu", off, g_launch.dyn_size);
        return buf;
    }
    for (const smem_var &v : g_static_vars)
        if (off >= v.off && off < v.off + v.size) {
            snprintf(buf, sizeof buf, "NG_SHARED %s (%s), byte %zu of %zu", v.name, v.site,
                     off - v.off, v.size);
            return buf;
        }
    snprintf(buf, sizeof buf, "static shared memory, arena byte %zu", off);
    return buf;
}

std::string thread_text(uint16_t tid) {
    const int x = tid % g_block_dim.x, y = tid / g_block_dim.x % g_block_dim.y,
              z = tid / (g_block_dim.x * g_block_dim.y);
    char buf[96];
    snprintf(buf, sizeof buf, "thread (%d, %d, %d) (warp %d, lane %d)", x, y, z, tid >> 5,
             tid & 31);
    return buf;
}

[[noreturn]] void hazard(thread_state *t, const char *kind, bool dyn, size_t off, size_t n,
                         bool is_write, int32_t pc, const shadow_acc *other, bool other_write) {
    std::string msg = std::string("shared-memory race (") + kind + ") on " + smem_place(dyn, off) +
                      " (an access of " + std::to_string(n) + " bytes):\n    " +
                      (is_write ? "write" : "read") + " by " + thread_text((uint16_t)t->linear) +
                      " at " + pc_site(pc);
    if (other)
        msg += std::string("\n    ") + (other_write ? "write" : "read") + " by " +
               thread_text(other->tid) + " at " + pc_site(other->pc) +
               "\n    with no __syncthreads between them";
    else
        msg += "\n    no thread of this block has written that byte since the block started";
    fault(t, "%s", msg.c_str());
    __builtin_unreachable();
}

/* The store the running thread is about to make (its hook has run, the
 * store follows at once): checked at the thread's next rc_flush. */
struct pending_store {
    bool active;
    bool dyn;
    size_t off, n;
    shadow *sh;
    const unsigned char *mem;
    unsigned char old[16];
    uint32_t ep;
    int32_t pc;
} g_pending;

void rc_flush() {
    if (!g_pending.active) return;
    g_pending.active = false;
    thread_state *t = g_running;
    const pending_store &q = g_pending;
    if (!t || q.ep != g_epoch) return; /* a fault abandoned the block */
    const uint16_t tid = (uint16_t)t->linear;
    const int warp = t->warp;
    for (size_t k = 0; k < q.n; k++) {
        shadow &x = q.sh[q.off + k];
        x.init = q.ep;
        if (q.mem[k] == q.old[k]) continue; /* left as it was: not a write */
        if (x.w.epoch == q.ep && x.w.tid >> 5 != warp)
            hazard(t, "write after write", q.dyn, q.off + k, q.n, true, q.pc, &x.w, true);
        if (x.r.epoch == q.ep && x.r.tid >> 5 != warp)
            hazard(t, "write after read", q.dyn, q.off + k, q.n, true, q.pc, &x.r, false);
        if (x.r2.epoch == q.ep && x.r2.tid >> 5 != warp)
            hazard(t, "write after read", q.dyn, q.off + k, q.n, true, q.pc, &x.r2, false);
        x.w = shadow_acc{q.ep, tid, q.pc};
    }
}

inline void rc_access(const void *p, size_t n, bool is_write, const void *ret) {
    const uintptr_t a = (uintptr_t)p;
    if (g_racecheck_off) return;
    if (g_pending.active) rc_flush();
    shadow *sh;
    bool dyn;
    size_t off;
    if (a - (uintptr_t)g_static_smem < g_static_used) {
        off = a - (uintptr_t)g_static_smem, dyn = false, sh = g_shadow_static.data();
    } else if (a - (uintptr_t)g_launch.dyn < g_launch.dyn_size) {
        off = a - (uintptr_t)g_launch.dyn, dyn = true, sh = g_shadow_dyn.data();
    } else {
        return;
    }
    thread_state *t = g_running;
    if (!t) return;
    g_racecheck_seen = true;
    g_races_checked++;
    const uint32_t ep = g_epoch, ep0 = g_block_epoch;
    const uint16_t tid = (uint16_t)t->linear;
    const int warp = t->warp;
    const int32_t pc = (int32_t)((intptr_t)ret - (intptr_t)rc_base());
    const size_t lim = dyn ? g_launch.dyn_size : g_static_used,
                 end = off + n <= lim ? off + n : lim;
    if (is_write && end - off <= sizeof g_pending.old) {
        g_pending.active = true;
        g_pending.dyn = dyn;
        g_pending.off = off;
        g_pending.n = end - off;
        g_pending.sh = sh;
        g_pending.mem = (const unsigned char *)p;
        memcpy(g_pending.old, p, end - off);
        g_pending.ep = ep;
        g_pending.pc = pc;
        return;
    }
    for (size_t i = off; i < end; i++) {
        shadow &x = sh[i];
        if (is_write) { /* a range too long to compare: every byte a write */
            if (x.w.epoch == ep && x.w.tid >> 5 != warp)
                hazard(t, "write after write", dyn, i, n, true, pc, &x.w, true);
            if (x.r.epoch == ep && x.r.tid >> 5 != warp)
                hazard(t, "write after read", dyn, i, n, true, pc, &x.r, false);
            if (x.r2.epoch == ep && x.r2.tid >> 5 != warp)
                hazard(t, "write after read", dyn, i, n, true, pc, &x.r2, false);
            x.w = shadow_acc{ep, tid, pc};
            x.init = ep;
        } else {
            if (x.init < ep0)
                hazard(t, "read of unwritten memory", dyn, i, n, false, pc, nullptr, false);
            if (x.w.epoch == ep && x.w.tid >> 5 != warp)
                hazard(t, "read after write", dyn, i, n, false, pc, &x.w, true);
            if (x.r.epoch != ep)
                x.r = shadow_acc{ep, tid, pc};
            else if (x.r.tid >> 5 != warp && x.r2.epoch != ep)
                x.r2 = shadow_acc{ep, tid, pc};
        }
    }
}

/* Run block `lin` (x fastest) of the grid; false after a fault. */
bool run_block(uint64_t lin) {
    g_block_idx.x = (unsigned)(lin % g_grid_dim.x);
    g_block_idx.y = (unsigned)(lin / g_grid_dim.x % g_grid_dim.y);
    g_block_idx.z = (unsigned)(lin / ((uint64_t)g_grid_dim.x * g_grid_dim.y));
    poison_shared();
    new_epoch(true);
    const int n = g_launch.nthreads;
    for (int i = 0; i < n; i++) {
        thread_state &t = g_threads[i];
        t.v.idx.x = (unsigned)(i % g_block_dim.x);
        t.v.idx.y = (unsigned)(i / g_block_dim.x % g_block_dim.y);
        t.v.idx.z = (unsigned)(i / (g_block_dim.x * g_block_dim.y));
        t.linear = i;
        t.lane = i & 31;
        t.warp = i >> 5;
        t.state = T_RUN;
        t.site = nullptr;
        t.cp_queue.clear();
        t.cp_groups = 0;
        init_fiber(&t);
    }
    g_launch.live = n;
    g_launch.at_barrier = 0;
    g_launch.exited = 0;
    const int nwarps = (n + 31) / 32;
    g_launch.nwarps = nwarps;
    g_launch.waiting.assign(nwarps, 0u);
    g_launch.gone.assign(nwarps, 0u);
    g_launch.present.assign(nwarps, 0xffffffffu);
    if (n % 32) g_launch.present[nwarps - 1] = (1u << (n % 32)) - 1u;
    g_launch.runnable = g_launch.present;
    /* RANDOM: per block, warps run serially (each on to its next barrier),
     * mostly serially (7 in 8 stops), or drawn afresh at every stop */
    if (g_launch.policy == P_RANDOM) {
        static const int kStay[3] = {8, 7, 0};
        g_launch.stay = kStay[next_random() % 3];
    }
    while (g_launch.live > 0) {
        g_launch.cur_warp = -1;
        thread_state *first = next_in_sweep();
        const bool ran = first != nullptr;
        if (first) switch_to(nullptr, first, false); /* runs the whole sweep, fiber to fiber */
        if (g_launch.fault) return false;
        if (g_launch.at_barrier > 0 && g_launch.at_barrier == g_launch.live) {
            const thread_state *b0 = nullptr;
            for (int i = 0; i < n; i++) {
                const thread_state &t = g_threads[i];
                if (t.state != T_BAR) continue;
                if (!b0)
                    b0 = &t;
                else if (t.site != b0->site && strcmp(t.site, b0->site) != 0)
                    fault(
                        nullptr,
                        "threads wait at different __syncthreads: thread %d at %s, thread %d at %s",
                        b0->linear, b0->site, t.linear, t.site);
            }
            if (g_launch.fault) return false;
            if (g_launch.exited > 0) {
                fault(
                    nullptr,
                    "__syncthreads at %s reached by %d of the block's %d threads; the others exited:%s",
                    b0->site, g_launch.at_barrier, n, positions().c_str());
                return false;
            }
            uint64_t any = 0; /* __syncthreads_or: every thread gets the OR */
            for (int i = 0; i < n; i++)
                if (g_threads[i].state == T_BAR) any |= g_threads[i].value;
            for (int i = 0; i < n; i++)
                if (g_threads[i].state == T_BAR) {
                    g_threads[i].result = any;
                    set_state(&g_threads[i], T_RUN);
                }
            g_launch.at_barrier = 0;
            new_epoch(false);
            continue;
        }
        if (!ran) {
            fault(nullptr, "deadlock: no thread can go on:%s", positions().c_str());
            return false;
        }
    }
    return true;
}

bool run_grid(int which) {
    const schedule sc = the_schedule(which);
    g_launch.schedule = which;
    g_launch.reverse = sc.reverse;
    g_launch.policy = sc.policy;
    g_launch.poison = sc.poison;
    /* splitmix64 of the seed and the launch's number: never 0 (xorshift) */
    uint64_t z = g_seed_env() + 0x9e3779b97f4a7c15ull * (uint64_t)(g_launches + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    g_launch.rng = (z ^ (z >> 31)) | 1u;
    const uint64_t nb = (uint64_t)g_grid_dim.x * g_grid_dim.y * g_grid_dim.z;
    if (!sc.shuffled) {
        for (uint64_t b = 0; b < nb; b++)
            if (!run_block(b)) return false;
        return true;
    }
    /* a permutation of the blocks from the schedule's generator */
    std::vector<uint64_t> order(nb);
    for (uint64_t b = 0; b < nb; b++) order[b] = b;
    for (uint64_t i = nb; i > 1; i--) std::swap(order[i - 1], order[next_random() % i]);
    for (uint64_t b : order)
        if (!run_block(b)) return false;
    return true;
}

struct snapshot {
    std::vector<std::pair<alloc *, std::vector<char>>> bufs;
    void take() {
        bufs.clear();
        for (auto &kv : g_allocs)
            bufs.emplace_back(&kv.second,
                              std::vector<char>(kv.second.ptr, kv.second.ptr + kv.second.size));
    }
    void restore() const {
        for (auto &b : bufs) memcpy(b.first->ptr, b.second.data(), b.second.size());
    }
};

} // namespace

/* ---- the device side's entry points ------------------------------------------ */

void syncthreads(const char *site) { (void)syncthreads_or(0, site); }

int syncthreads_or(int pred, const char *site) {
    thread_state *t = running("__syncthreads");
    rc_flush();
    set_state(t, T_BAR);
    t->site = site;
    t->value = pred != 0; /* the release ORs the waiting threads' predicates into result */
    g_launch.at_barrier++;
    leave(t, false);
    return (int)t->result;
}

uint64_t warp_op(warp_kind kind, unsigned mask, uint64_t value, int arg, int width,
                 const char *site) {
    thread_state *t = running("a warp intrinsic");
    rc_flush();
    if (width < 1 || width > 32 || (width & (width - 1)))
        fault(t, "%s at %s: width %d is not a power of two in [1, 32]", kind_name(kind), site,
              width);
    t->kind = kind;
    t->mask = mask;
    t->value = value;
    t->arg = arg;
    t->width = width;
    t->site = site;
    return post(t);
}

unsigned activemask() {
    thread_state *t = running("__activemask");
    return g_launch.present[t->warp] & ~g_launch.gone[t->warp];
}

void mma_m16n8k16(int bf16, float c[4], const uint32_t a[4], const uint32_t b[2],
                  const char *site) {
    thread_state *t = running("mma.sync");
    rc_flush();
    t->kind = W_MMA;
    t->mask = 0xffffffffu;
    t->site = site;
    t->mma_c = c;
    t->mma_a = a;
    t->mma_b = b;
    t->mma_bf16 = bf16;
    t->width = 32;
    (void)post(t);
}

bool ldmatrix_row(int num, const void *row, const char *site) {
    thread_state *t = running("ldmatrix");
    if (num != 1 && num != 2 && num != 4)
        fault(t, "ldmatrix at %s: .x%d is not a form of ldmatrix (x1, x2, x4)", site, num);
    if (t->lane >= 8 * num) return false; /* the form does not use this lane's address */
    const int m = t->lane >> 3, r = t->lane & 7;
    if ((uintptr_t)row % 16)
        fault(t,
              "ldmatrix.x%d at %s: lane %d's address %p (row %d of matrix %d) is not 16-byte "
              "aligned (each row is 16 contiguous, 16-byte aligned bytes of shared memory)",
              num, site, t->lane, row, r, m);
    if (!ng_emu_is_shared(row, 16))
        fault(t,
              "ldmatrix.x%d at %s: lane %d's address %p (row %d of matrix %d) is not in shared "
              "memory (the block's NG_SHARED variables or its %zu bytes of dynamic shared memory)",
              num, site, t->lane, row, r, m, g_launch.dyn_size);
    return true;
}

void ldmatrix_post(int num, int trans, uint32_t *r, const uint32_t row[4], const char *site) {
    thread_state *t = running("ldmatrix");
    rc_flush();
    t->kind = W_LDMATRIX;
    t->mask = 0xffffffffu;
    t->site = site;
    t->width = 32;
    t->ld_num = num;
    t->ld_trans = trans;
    memcpy(t->ld_row, row, sizeof t->ld_row);
    t->ld_out = r;
    (void)post(t);
}

void cp_async(int bytes, int cg, void *dst, const void *src, const char *site) {
    thread_state *t = running("cp.async");
    const char *form = cg ? "cp.async.cg" : "cp.async.ca";
    if (cg ? bytes != 16 : bytes != 4 && bytes != 8 && bytes != 16)
        fault(t, "%s at %s: %d bytes (.ca copies 4, 8 or 16 bytes, .cg 16)", form, site, bytes);
    if ((uintptr_t)dst % (unsigned)bytes || (uintptr_t)src % (unsigned)bytes)
        fault(t, "%s at %s: a %d-byte copy from %p to %p, not both %d-byte aligned", form, site,
              bytes, src, dst, bytes);
    if (!ng_emu_is_shared(dst, (size_t)bytes))
        fault(t, "%s at %s: the destination %p (%d bytes) is not in shared memory", form, site, dst,
              bytes);
    if (!find_alloc(src, (size_t)bytes))
        fault(t, "%s at %s: the source %p (%d bytes) is not inside one device buffer", form, site,
              src, bytes);
    cp_copy c;
    c.dst = (char *)dst;
    memset(c.words, 0, sizeof c.words);
    memcpy(c.words, src, (size_t)bytes); /* the source as it is now: read at issue */
    c.bytes = bytes;
    c.group = -1;
    c.site = site;
    t->cp_queue.push_back(c);
}

void cp_async_commit(const char *site) {
    thread_state *t = running("cp.async.commit_group");
    (void)site;
    const long long g = t->cp_groups++; /* an empty group is a group too */
    for (auto it = t->cp_queue.rbegin(); it != t->cp_queue.rend() && it->group < 0; ++it)
        it->group = g;
}

int cp_async_retire(int n, void **dst, uint32_t words[4], const char *site) {
    thread_state *t = running("cp.async.wait_group");
    if (n < 0) fault(t, "cp.async.wait_group %d at %s: N must be >= 0", n, site);
    /* groups 0 .. cp_groups - 1 were committed; all but the newest n retire */
    if (t->cp_queue.empty()) return 0;
    const cp_copy &c = t->cp_queue.front();
    if (c.group < 0 || c.group >= t->cp_groups - n) return 0;
    *dst = c.dst;
    memcpy(words, c.words, sizeof c.words);
    const int bytes = c.bytes;
    t->cp_queue.pop_front();
    return bytes;
}

void trap(const char *site) {
    thread_state *t = running("__trap");
    fault(t, "__trap() at %s", site);
    __builtin_unreachable();
}

void *static_smem(smem_slot *slot, size_t size, size_t align, const char *name, const char *site) {
    thread_state *t = running("NG_SHARED");
    if (!slot->size) {
        const size_t off = round_up(g_static_used, align < 16 ? 16 : align);
        if (off + size > kStaticSmem)
            fault(
                t,
                "NG_SHARED: %zu bytes do not fit in the emulator's %zu-byte arena of static shared memory",
                size, kStaticSmem);
        memset(g_static_smem + off, g_launch.poison, size);
        slot->off = (uint32_t)off;
        slot->size = (uint32_t)size;
        g_static_used = off + size;
        g_static_vars.push_back(smem_var{off, size, name, site});
    }
    return g_static_smem + slot->off;
}

void *dynamic_smem() {
    (void)running("dynamic shared memory");
    return g_launch.dyn;
}

cudaError_t func_set_attribute(const void *fn, int attr, int value) {
    if (g_sticky) return g_sticky;
    if (const cudaError_t e = injected("cudaFuncSetAttribute")) return e;
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return fail(cudaErrorInvalidValue);
    if (value < 0 || value > device().optin_smem) {
        say("cudaFuncSetAttribute(MaxDynamicSharedMemorySize, %d) refused: sm_%d allows at most %d bytes",
            value, device().sm, device().optin_smem);
        return fail(cudaErrorInvalidValue);
    }
    g_max_dyn_smem[fn] = value;
    return cudaSuccess;
}

cudaError_t launch_impl(const char *kernel, const char *where, const void *fn, dim3 grid,
                        dim3 block, size_t smem, cudaStream_t stream, size_t param_bytes,
                        kernel_body *body) {
    (void)stream;
    if (g_sticky) return fail(g_sticky);
    if (g_running) {
        say("a kernel launched another kernel (dynamic parallelism is not emulated)");
        abort();
    }
    const std::string name = display_name(kernel, where);
    const uint64_t threads = (uint64_t)block.x * block.y * block.z;
    const char *why = nullptr;
    char msg[256];
    if (threads == 0 || threads > 1024) {
        snprintf(msg, sizeof msg, "%llu threads per block (%u x %u x %u); the limit is 1024",
                 (unsigned long long)threads, block.x, block.y, block.z);
        why = msg;
    } else if (block.z > 64) {
        snprintf(msg, sizeof msg, "blockDim.z %u; the limit is 64", block.z);
        why = msg;
    } else if (grid.x == 0 || grid.y == 0 || grid.z == 0) {
        snprintf(msg, sizeof msg, "an empty grid (%u x %u x %u)", grid.x, grid.y, grid.z);
        why = msg;
    } else if (grid.x > 2147483647u) {
        snprintf(msg, sizeof msg, "gridDim.x %u; the limit is 2147483647", grid.x);
        why = msg;
    } else if (grid.y > 65535 || grid.z > 65535) {
        snprintf(msg, sizeof msg, "gridDim.%c %u; the limit is 65535", grid.y > 65535 ? 'y' : 'z',
                 grid.y > 65535 ? grid.y : grid.z);
        why = msg;
    }
    if (why) {
        say("launch of %s refused: %s", name.c_str(), why);
        return fail(cudaErrorInvalidConfiguration);
    }
    auto lim = g_max_dyn_smem.find(fn);
    const size_t smem_max = lim != g_max_dyn_smem.end() ? (size_t)lim->second : 48 * 1024;
    if (smem > smem_max) {
        say("launch of %s refused: %zu bytes of dynamic shared memory; the limit is %zu (48 KiB unless raised with "
            "cudaFuncSetAttribute, at most %d on sm_%d)",
            name.c_str(), smem, smem_max, device().optin_smem, device().sm);
        return fail(cudaErrorInvalidValue);
    }
    if (param_bytes > 32764) {
        say("launch of %s refused: %zu bytes of kernel parameters; the limit is 32764",
            name.c_str(), param_bytes);
        return fail(cudaErrorInvalidValue);
    }
    install_handlers();
    static const bool rc_env_read = [] {
        const char *e = getenv("NG_EMU_RACECHECK");
        g_racecheck_off = e && strcmp(e, "0") == 0;
        return true;
    }();
    (void)rc_env_read;

    g_launch.name = name;
    g_launch.body = body;
    g_launch.nthreads = (int)threads;
    g_launch.dyn_size = smem;
    g_launch.dyn =
        (char *)malloc(smem ? smem : 1); /* exactly smem bytes: overruns are heap errors */
    if (g_shadow_dyn.size() < smem) g_shadow_dyn.resize(smem);
    g_launch.fault = false;
    g_launch.active = true;
    g_grid_dim = grid;
    g_block_dim = block;
    if (g_threads.size() < threads) g_threads.resize(threads);

    snapshot before, first;
    if (schedules() == 2) before.take();
    bool ok = run_grid(0);
    if (ok && schedules() == 2) {
        first.take();
        before.restore();
        ok = run_grid(1);
    }
    if (!ok)
        say("%s: the fault above is from %s", name.c_str(),
            schedule_text(g_launch.schedule).c_str());
    if (ok) {
        for (size_t i = 0; i < first.bufs.size() && ok; i++) {
            const alloc *b = first.bufs[i].first;
            const char *x = first.bufs[i].second.data();
            if (memcmp(x, b->ptr, b->size) == 0) continue;
            size_t off = 0;
            while (x[off] == b->ptr[off]) off++;
            say("%s: the two schedules disagree (a race, or a read of memory no thread wrote): device buffer of %zu "
                "bytes at %p, first difference at byte %zu (0x%02x in the first schedule, 0x%02x in the second); %s",
                name.c_str(), b->size, (void *)b->ptr, off, (unsigned char)x[off],
                (unsigned char)b->ptr[off], schedule_text(1).c_str());
            ok = false;
        }
    }
    free(g_launch.dyn);
    g_launch.dyn = nullptr;
    g_launch.active = false;
    g_launches++;
    if (!ok) {
        g_sticky = cudaErrorLaunchFailure;
        return fail(g_sticky);
    }
    return cudaSuccess;
}

} // namespace ng_emu

/* ---- the runtime API ------------------------------------------------------------ */

using namespace ng_emu;

#define NG_EMU_STICKY()                                                                            \
    do {                                                                                           \
        if (g_sticky) return fail(g_sticky);                                                       \
    } while (0)

extern "C" {

int ng_emu_set_sm(int sm) {
    const arch *a = find_arch(sm);
    if (!a) return -1;
    g_arch = a;
    return 0;
}
int ng_emu_sm(void) { return device().sm; }
void ng_emu_inject(const char *call, cudaError_t error) { g_inject[call] = error; }
void ng_emu_set_driver_version(int version) { g_driver_version = version; }
long long ng_emu_calls(const char *call) {
    auto it = g_calls.find(call);
    return it == g_calls.end() ? 0 : it->second;
}
long long ng_emu_launches(void) { return g_launches; }
int ng_emu_schedules(void) { return schedules(); }
int ng_emu_shared_poison(void) { return g_launch.poison; }
int ng_emu_is_shared(const void *p, size_t n) {
    const char *c = (const char *)p;
    return (c >= g_static_smem && c + n <= g_static_smem + g_static_used) ||
           (g_launch.dyn && c >= g_launch.dyn && c + n <= g_launch.dyn + g_launch.dyn_size);
}

cudaError_t cudaGetDeviceCount(int *count) {
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int dev) {
    NG_EMU_STICKY();
    return dev == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice);
}
cudaError_t cudaGetDevice(int *dev) {
    NG_EMU_STICKY();
    if (const cudaError_t e = injected("cudaGetDevice")) return e;
    *dev = 0;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int dev) {
    NG_EMU_STICKY();
    if (dev != 0) return fail(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "cuda_emu (CPU emulator of an sm_%d GPU)", device().sm);
    p->totalGlobalMem = (size_t)16 << 30;
    p->sharedMemPerBlock = 48 * 1024;
    p->sharedMemPerBlockOptin = (size_t)device().optin_smem;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = p->maxGridSize[2] = 65535;
    p->major = device().sm / 10;
    p->minor = device().sm % 10;
    p->multiProcessorCount = device().sms;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr attr, int dev) {
    NG_EMU_STICKY();
    if (const cudaError_t e = injected("cudaDeviceGetAttribute")) return e;
    if (dev != 0) return fail(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ: *v = 65535; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    case cudaDevAttrMultiProcessorCount: *v = device().sms; break;
    case cudaDevAttrComputeCapabilityMajor: *v = device().sm / 10; break;
    case cudaDevAttrComputeCapabilityMinor: *v = device().sm % 10; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = device().optin_smem; break;
    default: return fail(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) {
    *v = CUDART_VERSION;
    return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v) {
    *v = g_driver_version;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
    NG_EMU_STICKY();
    return cudaSuccess;
}
cudaError_t cudaDeviceReset(void) {
    for (auto &kv : g_allocs) {
        asan_unpoison(kv.second.rw, kv.second.rw_len);
        munmap(kv.second.map, kv.second.map_len);
    }
    g_allocs.clear();
    g_max_dyn_smem.clear();
    g_sticky = g_last = cudaSuccess;
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
    const cudaError_t e = g_sticky ? g_sticky : g_last;
    g_last = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return g_sticky ? g_sticky : g_last; }

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorIllegalInstruction: return "cudaErrorIllegalInstruction";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    }
    return "cudaErrorUnknown";
}
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInsufficientDriver:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorIllegalInstruction: return "an illegal instruction was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}

cudaError_t cudaMalloc(void **ptr, size_t size) {
    NG_EMU_STICKY();
    install_handlers();
    const size_t data = round_up(size ? size : 1, 256), rw_len = round_up(data, kPage);
    const size_t post = size > kMinPost ? round_up(size, kPage) : kMinPost;
    const size_t map_len = kPre + rw_len + post;
    void *m = mmap(nullptr, map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
    alloc b;
    b.map = (char *)m;
    b.map_len = map_len;
    b.rw = b.map + kPre;
    b.rw_len = rw_len;
    if (mprotect(b.rw, rw_len, PROT_READ | PROT_WRITE) != 0) {
        munmap(m, map_len);
        return fail(cudaErrorMemoryAllocation);
    }
    b.ptr = b.rw + rw_len - data;
    b.size = size;
    memset(b.rw, 0xff, rw_len); /* what a fresh buffer holds: NaN in every float type */
    asan_poison(b.rw, (size_t)(b.ptr - b.rw));
    asan_poison(b.ptr + size, data - size);
    g_allocs[(uintptr_t)b.ptr] = b;
    *ptr = b.ptr;
    return cudaSuccess;
}

cudaError_t cudaFree(void *ptr) {
    NG_EMU_STICKY();
    if (!ptr) return cudaSuccess;
    auto it = g_allocs.find((uintptr_t)ptr);
    if (it == g_allocs.end()) {
        say("cudaFree(%p): not a pointer cudaMalloc returned", ptr);
        return fail(cudaErrorInvalidDevicePointer);
    }
    asan_unpoison(it->second.rw, it->second.rw_len);
    munmap(it->second.map, it->second.map_len);
    g_allocs.erase(it);
    return cudaSuccess;
}

static cudaError_t check_range(const void *p, size_t n, const char *what, const char *call) {
    if (n == 0 || find_alloc(p, n)) return cudaSuccess;
    say("%s: the %s range [%p, +%zu) is not inside one device buffer", call, what, p, n);
    return fail(cudaErrorInvalidValue);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
    NG_EMU_STICKY();
    if (kind == cudaMemcpyDefault)
        kind = find_alloc(dst, 1)
                   ? (find_alloc(src, 1) ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                   : (find_alloc(src, 1) ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    if ((kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) &&
        check_range(dst, n, "destination", "cudaMemcpy"))
        return g_last;
    if ((kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice) &&
        check_range(src, n, "source", "cudaMemcpy"))
        return g_last;
    if (n) memmove(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                            cudaStream_t) {
    return cudaMemcpy(dst, src, n, kind);
}
cudaError_t cudaMemset(void *p, int v, size_t n) {
    NG_EMU_STICKY();
    if (check_range(p, n, "destination", "cudaMemset")) return g_last;
    if (n) memset(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) { return cudaMemset(p, v, n); }

struct ng_emu_stream {
    unsigned flags;
};
cudaError_t cudaStreamCreate(cudaStream_t *s) {
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
    NG_EMU_STICKY();
    *s = new ng_emu_stream{flags};
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    NG_EMU_STICKY();
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
    NG_EMU_STICKY();
    return cudaSuccess; /* launches and copies ran when they were made */
}

} /* extern "C" */

/* ---- the race detector's entry points -------------------------------------------
 * What gcc -fsanitize=thread calls before each load and store of the kernels
 * (NG_EMU_RACECHECK builds; see rc_access), and the few other entry points
 * its instrumentation references. Atomic operations (std::atomic in host code
 * of the kernel files) are done here as the builtins they stand for. */

#define NG_RC_RET __builtin_return_address(0)
extern "C" {
void __tsan_init(void) {}
void __tsan_func_entry(void *) {}
void __tsan_func_exit(void) {}
void __tsan_vptr_update(void **, void *) {}
void __tsan_vptr_read(void **) {}
#define NG_RC_RW(n)                                                                                \
    void __tsan_read##n(void *p) { rc_access(p, n, false, NG_RC_RET); }                            \
    void __tsan_write##n(void *p) { rc_access(p, n, true, NG_RC_RET); }                            \
    void __tsan_unaligned_read##n(void *p) { rc_access(p, n, false, NG_RC_RET); }                  \
    void __tsan_unaligned_write##n(void *p) { rc_access(p, n, true, NG_RC_RET); }                  \
    void __tsan_volatile_read##n(void *p) { rc_access(p, n, false, NG_RC_RET); }                   \
    void __tsan_volatile_write##n(void *p) { rc_access(p, n, true, NG_RC_RET); }
NG_RC_RW(1)
NG_RC_RW(2)
NG_RC_RW(4)
NG_RC_RW(8)
NG_RC_RW(16)
#undef NG_RC_RW
void __tsan_read_range(void *p, unsigned long n) { rc_access(p, n, false, NG_RC_RET); }
void __tsan_write_range(void *p, unsigned long n) { rc_access(p, n, true, NG_RC_RET); }

/* memory orders as the instrumentation passes them: 0 relaxed .. 5 seq_cst */
#define NG_RC_ATOMIC(bits, T)                                                                      \
    T __tsan_atomic##bits##_load(const volatile T *a, int) {                                       \
        return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                               \
    }                                                                                              \
    void __tsan_atomic##bits##_store(volatile T *a, T v, int) {                                    \
        __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                  \
    }                                                                                              \
    T __tsan_atomic##bits##_exchange(volatile T *a, T v, int) {                                    \
        return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                        \
    }                                                                                              \
    T __tsan_atomic##bits##_fetch_add(volatile T *a, T v, int) {                                   \
        return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                         \
    }                                                                                              \
    T __tsan_atomic##bits##_fetch_sub(volatile T *a, T v, int) {                                   \
        return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                         \
    }                                                                                              \
    T __tsan_atomic##bits##_fetch_and(volatile T *a, T v, int) {                                   \
        return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                         \
    }                                                                                              \
    T __tsan_atomic##bits##_fetch_or(volatile T *a, T v, int) {                                    \
        return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                          \
    }                                                                                              \
    T __tsan_atomic##bits##_fetch_xor(volatile T *a, T v, int) {                                   \
        return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                         \
    }                                                                                              \
    int __tsan_atomic##bits##_compare_exchange_strong(volatile T *a, T *c, T v, int, int) {        \
        return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);    \
    }                                                                                              \
    int __tsan_atomic##bits##_compare_exchange_weak(volatile T *a, T *c, T v, int, int) {          \
        return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);     \
    }                                                                                              \
    T __tsan_atomic##bits##_compare_exchange_val(volatile T *a, T c, T v, int, int) {              \
        __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);          \
        return c;                                                                                  \
    }
NG_RC_ATOMIC(8, unsigned char)
NG_RC_ATOMIC(16, unsigned short)
NG_RC_ATOMIC(32, unsigned int)
NG_RC_ATOMIC(64, unsigned long long)
#undef NG_RC_ATOMIC
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

/* Whether the race detector has seen an access of shared memory (the kernels
 * were compiled for it), and how many it has checked. */
int ng_emu_racecheck(void) { return g_racecheck_seen; }
long long ng_emu_racecheck_accesses(void) { return g_races_checked; }
} /* extern "C" */
