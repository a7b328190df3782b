// The canonical order on a CUDA GPU (the CPU side, and the order itself, are documented in
// src/kernels/canonical.rs; the two must change together).
//
// One warp per output column. Lane l walks units l, l + 32, ... of its weight row (a unit is
// 32 values), keeps one f32 accumulator per activation row, and the warp folds its 32 lanes
// with an xor butterfly. Each block of the grid handles WARPS columns and R activation rows; the
// rows of a block share each weight load, and a row's arithmetic never depends on R, on its
// neighbours or on the grid: that is what makes the kernel batch invariant, and the same source
// runs for every row count.
//
// Every float operation is written as an intrinsic with its rounding (__fmul_rn, __fmaf_rn,
// __fadd_rn, __fdiv_rn, __int2float_rn) and the file is also built with --fmad=false, so the
// compiler can neither contract nor reassociate anything.

#ifdef __CUDACC_RTC__
// NVRTC has no C library headers (scripts/nvrtc_check.py compiles this file with it).
typedef unsigned char uint8_t;
typedef signed char int8_t;
#else
#include <stdint.h>
#endif
#include <cuda_fp16.h>

#define WARPS 4
#define LANES 32
#define UNIT 32

enum Dtype { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q8_0 = 3, Q4K = 4, Q6K = 5 };

template <int DT> struct Layout;
template <> struct Layout<Q4_0> { static constexpr int bytes = 18, units = 1; };
template <> struct Layout<Q4_1> { static constexpr int bytes = 20, units = 1; };
template <> struct Layout<Q5_0> { static constexpr int bytes = 22, units = 1; };
template <> struct Layout<Q8_0> { static constexpr int bytes = 34, units = 1; };
template <> struct Layout<Q4K> { static constexpr int bytes = 144, units = 8; };
template <> struct Layout<Q6K> { static constexpr int bytes = 210, units = 8; };

// One decoded unit: see `Unit` in canonical.rs. w holds 32 signed bytes, four per int.
struct Unit {
    int w[8];
    int scale_lo, scale_hi;
    float coef;
    float min_coef;
    int min_mult;
};

__device__ __forceinline__ float f16_at(const uint8_t *p) {
    return __half2float(__ushort_as_half(*(const unsigned short *)p));
}

__device__ __forceinline__ int u16_pair(const uint8_t *p) {
    const unsigned short *s = (const unsigned short *)p;
    return (int)((unsigned)s[0] | ((unsigned)s[1] << 16));
}

// Four bytes from a 2-byte aligned address.
__device__ __forceinline__ int load4_a2(const uint8_t *p) { return u16_pair(p); }
__device__ __forceinline__ int load4_a4(const uint8_t *p) { return *(const int *)p; }

// Q4_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t *s, int &sc, int &mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

template <int DT>
__device__ __forceinline__ void decode(const uint8_t *row, int u, Unit &un) {
    const uint8_t *b = row + (size_t)(u / Layout<DT>::units) * Layout<DT>::bytes;
    un.scale_lo = 1;
    un.scale_hi = 1;
    un.min_coef = 0.0f;
    un.min_mult = 0;
    if (DT == Q4_0 || DT == Q4_1) {
        const uint8_t *qs = b + (DT == Q4_0 ? 2 : 4);
        for (int i = 0; i < 4; ++i) {
            int v = DT == Q4_0 ? load4_a2(qs + 4 * i) : load4_a4(qs + 4 * i);
            int lo = v & 0x0F0F0F0F, hi = (v >> 4) & 0x0F0F0F0F;
            if (DT == Q4_0) {
                lo = __vsub4(lo, 0x08080808);
                hi = __vsub4(hi, 0x08080808);
            }
            un.w[i] = lo;
            un.w[4 + i] = hi;
        }
        un.coef = f16_at(b);
        if (DT == Q4_1) {
            un.min_coef = f16_at(b + 2);
            un.min_mult = 1;
        }
    } else if (DT == Q5_0) {
        const unsigned qh = (unsigned)u16_pair(b + 2);
        const uint8_t *qs = b + 6;
        for (int i = 0; i < 4; ++i) {
            int v = load4_a2(qs + 4 * i);
            int lo = v & 0x0F0F0F0F, hi = (v >> 4) & 0x0F0F0F0F;
            int hlo = 0, hhi = 0;
            for (int j = 0; j < 4; ++j) {
                hlo |= ((qh >> (4 * i + j)) & 1) << (8 * j + 4);
                hhi |= ((qh >> (16 + 4 * i + j)) & 1) << (8 * j + 4);
            }
            un.w[i] = __vsub4(lo | hlo, 0x10101010);
            un.w[4 + i] = __vsub4(hi | hhi, 0x10101010);
        }
        un.coef = f16_at(b);
    } else if (DT == Q8_0) {
        for (int i = 0; i < 8; ++i) un.w[i] = load4_a2(b + 2 + 4 * i);
        un.coef = f16_at(b);
    } else if (DT == Q4K) {
        const int j = u % 8;
        int sc, mn;
        scale_min_k4(j, b + 4, sc, mn);
        const uint8_t *qs = b + 16 + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 8; ++i) un.w[i] = (load4_a4(qs + 4 * i) >> shift) & 0x0F0F0F0F;
        un.scale_lo = sc;
        un.scale_hi = sc;
        un.coef = f16_at(b);
        un.min_coef = -f16_at(b + 2);
        un.min_mult = mn;
    } else if (DT == Q6K) {
        const int j = u % 8, h = j / 4, t = j % 4;
        const uint8_t *ql = b + 64 * h + 32 * (t % 2);
        const uint8_t *qh = b + 128 + 32 * h;
        const int shift = 4 * (t / 2);
        for (int i = 0; i < 8; ++i) {
            int lo = (load4_a2(ql + 4 * i) >> shift) & 0x0F0F0F0F;
            int hi = ((load4_a2(qh + 4 * i) >> (2 * t)) & 0x03030303) << 4;
            un.w[i] = __vsub4(lo | hi, 0x20202020);
        }
        const int8_t *sc = (const int8_t *)(b + 192);
        un.scale_lo = sc[8 * h + 2 * t];
        un.scale_hi = sc[8 * h + 2 * t + 1];
        un.coef = f16_at(b + 208);
    }
}

// `Unit::accumulate` in canonical.rs.
template <int DT>
__device__ __forceinline__ float accumulate(const Unit &un, const int *q, float d, float acc) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) lo = __dp4a(un.w[i], q[i], lo);
#pragma unroll
    for (int i = 4; i < 8; ++i) hi = __dp4a(un.w[i], q[i], hi);
    const int c = un.scale_lo * lo + un.scale_hi * hi;
    acc = __fmaf_rn(__fmul_rn(un.coef, d), __int2float_rn(c), acc);
    if (DT == Q4_1 || DT == Q4K) {
        int sum = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) sum = __dp4a(q[i], 0x01010101, sum);
        acc = __fmaf_rn(__fmul_rn(un.min_coef, d), __int2float_rn(un.min_mult * sum), acc);
    }
    return acc;
}

__device__ __forceinline__ float butterfly(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// x: rows of k f32. q: rows of k int8; d: rows of k / 32 scales. One thread per unit.
extern "C" __global__ void canonical_quantize(const float *__restrict__ x, int8_t *__restrict__ q,
                                              float *__restrict__ d, int units_total) {
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= units_total) return;
    const float *xs = x + (size_t)u * UNIT;
    float amax = 0.0f;
    for (int i = 0; i < UNIT; ++i) amax = fmaxf(amax, fabsf(xs[i]));
    const float scale = __fdiv_rn(amax, 127.0f);
    const float inv = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
    int8_t *qs = q + (size_t)u * UNIT;
    for (int i = 0; i < UNIT; ++i) {
        float v = rintf(__fmul_rn(xs[i], inv));
        qs[i] = (int8_t)fminf(fmaxf(v, -127.0f), 127.0f);
    }
    d[u] = scale;
}

// w: n rows of k quantized values; y: rows of n. Grid: (ceil(n / WARPS), ceil(rows / R)).
// U > 1: each lane decodes U of its units (u, u + 32, ...) before accumulating them, in the same
// order, so that more weight loads are in flight (for one row and long rows, where the kernel
// waits on memory one unit at a time).
template <int DT, int R, int U = 1>
__device__ void canonical_matvec(const uint8_t *__restrict__ w, const int8_t *__restrict__ q,
                                 const float *__restrict__ d, float *__restrict__ y, int n, int k,
                                 int rows) {
    const int lane = threadIdx.x % LANES;
    const int col = blockIdx.x * WARPS + threadIdx.x / LANES;
    const int row0 = blockIdx.y * R;
    if (col >= n) return;
    const int units = k / UNIT;
    const size_t row_bytes = (size_t)(units / Layout<DT>::units) * Layout<DT>::bytes;
    const uint8_t *wrow = w + (size_t)col * row_bytes;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int u0 = lane; u0 < units; u0 += LANES * U) {
        Unit un[U];
#pragma unroll
        for (int x = 0; x < U; ++x)
            if (u0 + x * LANES < units) decode<DT>(wrow, u0 + x * LANES, un[x]);
#pragma unroll
        for (int x = 0; x < U; ++x) {
            const int u = u0 + x * LANES;
            if (u >= units) break;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (row0 + r < rows) {
                    const size_t at = (size_t)(row0 + r) * k + (size_t)u * UNIT;
                    const int *qa = (const int *)(q + at);
                    int qv[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i) qv[i] = qa[i];
                    acc[r] = accumulate<DT>(un[x], qv, d[(size_t)(row0 + r) * units + u], acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = butterfly(acc[r]);
        if (lane == 0 && row0 + r < rows) y[(size_t)(row0 + r) * n + col] = s;
    }
}

// Dense f32 weights (the reference lane): element e in lane e % 32, fma, the same butterfly.
template <int R>
__device__ void canonical_dense(const float *__restrict__ w, const float *__restrict__ x,
                                float *__restrict__ y, int n, int k, int rows) {
    const int lane = threadIdx.x % LANES;
    const int col = blockIdx.x * WARPS + threadIdx.x / LANES;
    const int row0 = blockIdx.y * R;
    if (col >= n) return;
    const float *wrow = w + (size_t)col * k;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int e = lane; e < k; e += LANES) {
        const float wv = wrow[e];
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (row0 + r < rows) acc[r] = __fmaf_rn(wv, x[(size_t)(row0 + r) * k + e], acc[r]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = butterfly(acc[r]);
        if (lane == 0 && row0 + r < rows) y[(size_t)(row0 + r) * n + col] = s;
    }
}

#define MATVEC(NAME, DT, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                  \
        canonical_##NAME##_r##R(const uint8_t *w, const int8_t *q, const float *d, float *y,      \
                                int n, int k, int rows) {                                        \
        canonical_matvec<DT, R>(w, q, d, y, n, k, rows);                                         \
    }
#define MATVEC_U4(NAME, DT)                                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                  \
        canonical_##NAME##_r1_u4(const uint8_t *w, const int8_t *q, const float *d, float *y,     \
                                 int n, int k, int rows) {                                       \
        canonical_matvec<DT, 1, 4>(w, q, d, y, n, k, rows);                                      \
    }
#define MATVEC_ALL_R(NAME, DT)                                                                   \
    MATVEC(NAME, DT, 1) MATVEC(NAME, DT, 2) MATVEC(NAME, DT, 4) MATVEC(NAME, DT, 8) MATVEC_U4(NAME, DT)

MATVEC_ALL_R(q4_0, Q4_0)
MATVEC_ALL_R(q4_1, Q4_1)
MATVEC_ALL_R(q5_0, Q5_0)
MATVEC_ALL_R(q8_0, Q8_0)
MATVEC_ALL_R(q4k, Q4K)
MATVEC_ALL_R(q6k, Q6K)

// The tiled kernel: many rows and several columns per block, the same order for every output.
//
// A block of TILE_WARPS warps computes RT activation rows against TILE_WARPS * CT columns (CT per
// warp). Lane l still owns units l, l + 32, ... of every output it holds: thread (warp, l) keeps
// RT x CT accumulators, each walking its units in increasing u with the same operations as
// `accumulate`, and each output folds by the same butterfly. What changes is only who loads
// what: the RT rows' quantized activations of a chunk of 32 units are staged once in shared
// memory for all the block's warps (with each unit's integer sum, the Q4_1/Q4_K min term's
// operand), and a warp decodes each weight unit once for its RT rows. So an output's bits are
// the same for every (RT, CT) and every row count (tests/canonical.rs runs this loop lane by
// lane: `canonical_emulate::emulate_tile`).
#define TILE_WARPS 4

// (float) v for |v| < 2^22, exactly (the same value __int2float_rn gives): v added into the
// mantissa of 1.5 * 2^23, whose unit is 1, then 1.5 * 2^23 taken away. An integer add and a float
// add, where the conversion instruction runs at a quarter of the integer rate. The bounds of
// every use: Q8_0 32 * 128 * 127; Q4_0, Q4_1, Q5_0 less; Q4_K 63 * 32 * 15 * 127 and 63 * 32 * 127
// (all below 2^22 = 4194304; `small_int_to_float` in canonical_emulate.rs checks them).
__device__ __forceinline__ float small_int_to_float(int v) {
    return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// `Unit::accumulate` against a staged unit: a, b its 32 int8 values (16 + 16), du its scale,
// sum the integer sum of its values. The integer parts are those of `accumulate` regrouped
// (exact integer arithmetic: sc * lo + sc * hi == sc * (lo + hi)); the float operations are the
// same, in the same order.
template <int DT>
__device__ __forceinline__ float tile_accumulate(const Unit &un, const int4 &a, const int4 &b, float du,
                                                 int sum, float acc) {
    int c;
    if (DT == Q6K) {
        int lo = __dp4a(un.w[0], a.x, 0);
        lo = __dp4a(un.w[1], a.y, lo);
        lo = __dp4a(un.w[2], a.z, lo);
        lo = __dp4a(un.w[3], a.w, lo);
        int hi = __dp4a(un.w[4], b.x, 0);
        hi = __dp4a(un.w[5], b.y, hi);
        hi = __dp4a(un.w[6], b.z, hi);
        hi = __dp4a(un.w[7], b.w, hi);
        c = un.scale_lo * lo + un.scale_hi * hi;
    } else {
        int dot = __dp4a(un.w[0], a.x, 0);
        dot = __dp4a(un.w[1], a.y, dot);
        dot = __dp4a(un.w[2], a.z, dot);
        dot = __dp4a(un.w[3], a.w, dot);
        dot = __dp4a(un.w[4], b.x, dot);
        dot = __dp4a(un.w[5], b.y, dot);
        dot = __dp4a(un.w[6], b.z, dot);
        dot = __dp4a(un.w[7], b.w, dot);
        c = DT == Q4K ? un.scale_lo * dot : dot;
    }
    // Q6_K's c can reach 2 * 128 * 16 * 32 * 127 (past 2^22): the conversion instruction.
    acc = __fmaf_rn(__fmul_rn(un.coef, du), DT == Q6K ? __int2float_rn(c) : small_int_to_float(c), acc);
    if (DT == Q4_1 || DT == Q4K)
        acc = __fmaf_rn(__fmul_rn(un.min_coef, du), small_int_to_float(un.min_mult * sum), acc);
    return acc;
}

// Grid: (ceil(rows / RT), ceil(n / (TILE_WARPS * CT))); blocks of TILE_WARPS warps. Row tiles
// vary fastest, so the blocks running together share their weight columns in L2.
template <int DT, int RT, int CT>
__device__ void canonical_tile(const uint8_t *__restrict__ w, const int8_t *__restrict__ q,
                               const float *__restrict__ d, float *__restrict__ y, int n, int k, int rows) {
    // One chunk of 32 units of RT rows: unit j's values 0..16 at sq[r][0][j], 16..32 at
    // sq[r][1][j] (a lane's 16-byte reads are then consecutive: no bank conflicts).
    __shared__ int4 sq[RT][2][LANES];
    __shared__ float sd[RT][LANES];
    __shared__ int ss[RT][LANES];
    const int lane = threadIdx.x % LANES;
    const int warp = threadIdx.x / LANES;
    const int row0 = blockIdx.x * RT;
    const int col0 = (blockIdx.y * TILE_WARPS + warp) * CT;
    const int units = k / UNIT;
    const size_t row_bytes = (size_t)(units / Layout<DT>::units) * Layout<DT>::bytes;
    float acc[RT][CT];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int c = 0; c < CT; ++c) acc[r][c] = 0.0f;
    for (int base = 0; base < units; base += LANES) {
        const int u = base + lane;
        // This lane's weight units first, so that their loads are in flight with the staging's.
        Unit un[CT];
        if (u < units) {
#pragma unroll
            for (int c = 0; c < CT; ++c) {
                // Columns past n decode the last column (valid memory); their sums are dropped.
                const int col = min(col0 + c, n - 1);
                decode<DT>(w + (size_t)col * row_bytes, u, un[c]);
            }
        }
        __syncthreads();  // the previous chunk's reads of the tile are done
        constexpr int STAGE = (RT * LANES + TILE_WARPS * LANES - 1) / (TILE_WARPS * LANES);
#pragma unroll
        for (int it = 0; it < STAGE; ++it) {
            const int i = threadIdx.x + it * TILE_WARPS * LANES;
            if (i < RT * LANES) {
                const int r = i / LANES, j = i % LANES, uj = base + j;
                int4 a = make_int4(0, 0, 0, 0), b = make_int4(0, 0, 0, 0);
                float du = 0.0f;
                int sum = 0;
                if (row0 + r < rows && uj < units) {
                    const int4 *src = (const int4 *)(q + (size_t)(row0 + r) * k + (size_t)uj * UNIT);
                    a = src[0];
                    b = src[1];
                    du = d[(size_t)(row0 + r) * units + uj];
                    sum = __dp4a(a.x, 0x01010101, sum);
                    sum = __dp4a(a.y, 0x01010101, sum);
                    sum = __dp4a(a.z, 0x01010101, sum);
                    sum = __dp4a(a.w, 0x01010101, sum);
                    sum = __dp4a(b.x, 0x01010101, sum);
                    sum = __dp4a(b.y, 0x01010101, sum);
                    sum = __dp4a(b.z, 0x01010101, sum);
                    sum = __dp4a(b.w, 0x01010101, sum);
                }
                sq[r][0][j] = a;
                sq[r][1][j] = b;
                sd[r][j] = du;
                ss[r][j] = sum;
            }
        }
        __syncthreads();
        if (u < units) {
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const int4 a = sq[r][0][lane], b = sq[r][1][lane];
                const float du = sd[r][lane];
                const int sum = ss[r][lane];
#pragma unroll
                for (int c = 0; c < CT; ++c) acc[r][c] = tile_accumulate<DT>(un[c], a, b, du, sum, acc[r][c]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int c = 0; c < CT; ++c) {
            const float s = butterfly(acc[r][c]);
            if (lane == (r * CT + c) % LANES && row0 + r < rows && col0 + c < n)
                y[(size_t)(row0 + r) * n + col0 + c] = s;
        }
}

#define TILE(NAME, DT, RT, CT)                                                                   \
    extern "C" __global__ void __launch_bounds__(TILE_WARPS * LANES)                             \
        canonical_tile_##NAME##_r##RT##_c##CT(const uint8_t *w, const int8_t *q, const float *d,  \
                                              float *y, int n, int k, int rows) {                \
        canonical_tile<DT, RT, CT>(w, q, d, y, n, k, rows);                                      \
    }
// The (rows, columns per warp) tiles: `TILES` in canonical_emulate.rs.
#define TILE_ALL(NAME, DT)                                                                       \
    TILE(NAME, DT, 1, 4) TILE(NAME, DT, 2, 4) TILE(NAME, DT, 4, 4) TILE(NAME, DT, 8, 4)           \
    TILE(NAME, DT, 16, 4) TILE(NAME, DT, 32, 2)

TILE_ALL(q4_0, Q4_0)
TILE_ALL(q4_1, Q4_1)
TILE_ALL(q5_0, Q5_0)
TILE_ALL(q8_0, Q8_0)
TILE_ALL(q4k, Q4K)
TILE_ALL(q6k, Q6K)

// The tensor-core kernel: the integer part of each unit on int8 MMA (exact), the float part in
// the canonical lane order. A block of MMA_WARPS warps computes MMA_ROWS rows against MMA_COLS
// columns; warp w holds the lane slots w, w + 8, w + 16, w + 24 of every output of the block
// (slot l: units l, l + 32, ... in increasing order, as lane l of the warp kernel), so each
// thread keeps, for each of its fragment's outputs, one accumulator per slot, walked with the
// operations of `accumulate`. The butterfly's first two levels (offsets 16 and 8) pair slots of
// the same warp and run in registers; the last three fold the 8 warps' sums through shared
// memory, in the butterfly's order. `canonical_emulate::emulate_mma` runs this thread by thread.
//
// Fragments of mma.m16n8k32 (.s8), lane = 4 g + t: A (16 x 32, row) a0 = A[g][4t..], a1 =
// A[g + 8][4t..], a2 = A[g][16 + 4t..], a3 = A[g + 8][16 + 4t..]; B (32 x 8, col) b0 = B[4t..][g],
// b1 = B[16 + 4t..][g]; D (16 x 8) d0 = D[g][2t], d1 = D[g][2t + 1], d2 = D[g + 8][2t], d3 =
// D[g + 8][2t + 1]. m16n8k16 (Q6_K's halves, each with its own scale) takes a0, a1 and b0.
#define MMA_WARPS 8
#define MMA_ROWS 32
#define MMA_COLS 16
#define MMA_SLOTS 4
// Words per staged row: 32 units of 8 words, plus 4 so that the 8 rows of a fragment fall in
// different banks.
#define MMA_ROW_WORDS (LANES * 8 + 4)

__device__ __forceinline__ void mma_k32(int (&dd)[4], const int (&a)[4], int b0, int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n"
                 : "=r"(dd[0]), "=r"(dd[1]), "=r"(dd[2]), "=r"(dd[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}

__device__ __forceinline__ void mma_k16(int (&dd)[4], int a0, int a1, int b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
                 "{%7,%8,%9,%10};\n"
                 : "=r"(dd[0]), "=r"(dd[1]), "=r"(dd[2]), "=r"(dd[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0), "r"(0), "r"(0), "r"(0));
}

// Words i and 4 + i of unit u (values 4i..4i+4 and 16+4i..16+4i+4, as `decode` packs them).
template <int DT>
__device__ __forceinline__ void decode_pair(const uint8_t *row, int u, int i, int &w0, int &w1) {
    const uint8_t *b = row + (size_t)(u / Layout<DT>::units) * Layout<DT>::bytes;
    if (DT == Q4_0 || DT == Q4_1) {
        const int v = DT == Q4_0 ? load4_a2(b + 2 + 4 * i) : load4_a4(b + 4 + 4 * i);
        w0 = v & 0x0F0F0F0F;
        w1 = (v >> 4) & 0x0F0F0F0F;
        if (DT == Q4_0) {
            w0 = __vsub4(w0, 0x08080808);
            w1 = __vsub4(w1, 0x08080808);
        }
    } else if (DT == Q5_0) {
        const unsigned qh = (unsigned)u16_pair(b + 2);
        const int v = load4_a2(b + 6 + 4 * i);
        int hlo = 0, hhi = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            hlo |= ((qh >> (4 * i + j)) & 1) << (8 * j + 4);
            hhi |= ((qh >> (16 + 4 * i + j)) & 1) << (8 * j + 4);
        }
        w0 = __vsub4((v & 0x0F0F0F0F) | hlo, 0x10101010);
        w1 = __vsub4(((v >> 4) & 0x0F0F0F0F) | hhi, 0x10101010);
    } else if (DT == Q8_0) {
        w0 = load4_a2(b + 2 + 4 * i);
        w1 = load4_a2(b + 2 + 16 + 4 * i);
    } else if (DT == Q4K) {
        const int j = u % 8;
        const uint8_t *qs = b + 16 + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        w0 = (load4_a4(qs + 4 * i) >> shift) & 0x0F0F0F0F;
        w1 = (load4_a4(qs + 16 + 4 * i) >> shift) & 0x0F0F0F0F;
    } else if (DT == Q6K) {
        const int j = u % 8, h = j / 4, t = j % 4;
        const uint8_t *ql = b + 64 * h + 32 * (t % 2);
        const uint8_t *qh = b + 128 + 32 * h;
        const int shift = 4 * (t / 2);
        const int lo0 = (load4_a2(ql + 4 * i) >> shift) & 0x0F0F0F0F;
        const int hi0 = ((load4_a2(qh + 4 * i) >> (2 * t)) & 0x03030303) << 4;
        const int lo1 = (load4_a2(ql + 16 + 4 * i) >> shift) & 0x0F0F0F0F;
        const int hi1 = ((load4_a2(qh + 16 + 4 * i) >> (2 * t)) & 0x03030303) << 4;
        w0 = __vsub4(lo0 | hi0, 0x20202020);
        w1 = __vsub4(lo1 | hi1, 0x20202020);
    }
}

// The coefficients of unit u (`decode` without the values).
struct Coefs {
    int scale_lo, scale_hi;
    float coef, min_coef;
    int min_mult;
};

template <int DT>
__device__ __forceinline__ void decode_coefs(const uint8_t *row, int u, Coefs &cf) {
    const uint8_t *b = row + (size_t)(u / Layout<DT>::units) * Layout<DT>::bytes;
    cf.scale_lo = 1;
    cf.scale_hi = 1;
    cf.min_coef = 0.0f;
    cf.min_mult = 0;
    if (DT == Q4_0 || DT == Q5_0 || DT == Q8_0) {
        cf.coef = f16_at(b);
    } else if (DT == Q4_1) {
        cf.coef = f16_at(b);
        cf.min_coef = f16_at(b + 2);
        cf.min_mult = 1;
    } else if (DT == Q4K) {
        int sc, mn;
        scale_min_k4(u % 8, b + 4, sc, mn);
        cf.scale_lo = sc;
        cf.scale_hi = sc;
        cf.coef = f16_at(b);
        cf.min_coef = -f16_at(b + 2);
        cf.min_mult = mn;
    } else if (DT == Q6K) {
        const int j = u % 8, h = j / 4, t = j % 4;
        const int8_t *sc = (const int8_t *)(b + 192);
        cf.scale_lo = sc[8 * h + 2 * t];
        cf.scale_hi = sc[8 * h + 2 * t + 1];
        cf.coef = f16_at(b + 208);
    }
}

// Grid: (ceil(rows / MMA_ROWS), ceil(n / MMA_COLS)); blocks of MMA_WARPS warps.
template <int DT>
__device__ void canonical_mma(const uint8_t *__restrict__ w, const int8_t *__restrict__ q,
                              const float *__restrict__ d, float *__restrict__ y, int n, int k, int rows) {
    constexpr int MT = MMA_ROWS / 16, NT = MMA_COLS / 8, THREADS = MMA_WARPS * LANES;
    constexpr int STAGE_BYTES = MMA_ROWS * MMA_ROW_WORDS * 4 + 2 * MMA_ROWS * (LANES + 1) * 4;
    constexpr int PART_BYTES = MMA_ROWS * MMA_COLS * (MMA_WARPS + 1) * 4;
    __shared__ __align__(16) unsigned char smem[STAGE_BYTES > PART_BYTES ? STAGE_BYTES : PART_BYTES];
    int *sq = (int *)smem;                                      // [MMA_ROWS][MMA_ROW_WORDS]
    float *sd = (float *)(smem + MMA_ROWS * MMA_ROW_WORDS * 4);  // [MMA_ROWS][LANES + 1]
    int *ss = (int *)(sd + MMA_ROWS * (LANES + 1));              // [MMA_ROWS][LANES + 1]
    float *part = (float *)smem;                                 // [MMA_ROWS * MMA_COLS][MMA_WARPS + 1]

    const int lane = threadIdx.x % LANES, warp = threadIdx.x / LANES;
    const int g = lane / 4, t = lane % 4;
    const int row0 = blockIdx.x * MMA_ROWS;
    const int col0 = blockIdx.y * MMA_COLS;
    const int units = k / UNIT;
    const size_t row_bytes = (size_t)(units / Layout<DT>::units) * Layout<DT>::bytes;
    // acc[s][mt][nt][e]: slot warp + 8 s, output (16 mt + g + 8 (e / 2), 8 nt + 2 t + e % 2).
    float acc[MMA_SLOTS][MT][NT][4];
#pragma unroll
    for (int s = 0; s < MMA_SLOTS; ++s)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[s][mt][nt][e] = 0.0f;

    for (int base = 0; base < units; base += LANES) {
        __syncthreads();  // the previous chunk's reads of the stage are done
#pragma unroll
        for (int it = 0; it < MMA_ROWS * LANES / THREADS; ++it) {
            const int i = threadIdx.x + it * THREADS;
            const int r = i / LANES, j = i % LANES, uj = base + j;
            int4 a = make_int4(0, 0, 0, 0), b = make_int4(0, 0, 0, 0);
            float du = 0.0f;
            int sum = 0;
            if (row0 + r < rows && uj < units) {
                const int4 *src = (const int4 *)(q + (size_t)(row0 + r) * k + (size_t)uj * UNIT);
                a = src[0];
                b = src[1];
                du = d[(size_t)(row0 + r) * units + uj];
                sum = __dp4a(a.x, 0x01010101, sum);
                sum = __dp4a(a.y, 0x01010101, sum);
                sum = __dp4a(a.z, 0x01010101, sum);
                sum = __dp4a(a.w, 0x01010101, sum);
                sum = __dp4a(b.x, 0x01010101, sum);
                sum = __dp4a(b.y, 0x01010101, sum);
                sum = __dp4a(b.z, 0x01010101, sum);
                sum = __dp4a(b.w, 0x01010101, sum);
            }
            int4 *dst = (int4 *)(sq + r * MMA_ROW_WORDS + j * 8);
            dst[0] = a;
            dst[1] = b;
            sd[r * (LANES + 1) + j] = du;
            ss[r * (LANES + 1) + j] = sum;
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < MMA_SLOTS; ++s) {
            const int j = warp + 8 * s, u = base + j;
            if (u >= units) continue;  // the same for the whole warp
            int a[MT][4];
            float dr[MT][2];
            int sr[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r0 = 16 * mt + g, r1 = r0 + 8;
                a[mt][0] = sq[r0 * MMA_ROW_WORDS + j * 8 + t];
                a[mt][1] = sq[r1 * MMA_ROW_WORDS + j * 8 + t];
                a[mt][2] = sq[r0 * MMA_ROW_WORDS + j * 8 + 4 + t];
                a[mt][3] = sq[r1 * MMA_ROW_WORDS + j * 8 + 4 + t];
                dr[mt][0] = sd[r0 * (LANES + 1) + j];
                dr[mt][1] = sd[r1 * (LANES + 1) + j];
                sr[mt][0] = ss[r0 * (LANES + 1) + j];
                sr[mt][1] = ss[r1 * (LANES + 1) + j];
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                // B: column 8 nt + g's words t and 4 + t. Columns past n read the last column.
                int b0, b1;
                decode_pair<DT>(w + (size_t)min(col0 + 8 * nt + g, n - 1) * row_bytes, u, t, b0, b1);
                Coefs cf[2];
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    decode_coefs<DT>(w + (size_t)min(col0 + 8 * nt + 2 * t + e, n - 1) * row_bytes, u, cf[e]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    int c[4];
                    if (DT == Q6K) {
                        int lo[4], hi[4];
                        mma_k16(lo, a[mt][0], a[mt][1], b0);
                        mma_k16(hi, a[mt][2], a[mt][3], b1);
#pragma unroll
                        for (int e = 0; e < 4; ++e) c[e] = cf[e % 2].scale_lo * lo[e] + cf[e % 2].scale_hi * hi[e];
                    } else {
                        int dot[4];
                        mma_k32(dot, a[mt], b0, b1);
#pragma unroll
                        for (int e = 0; e < 4; ++e) c[e] = DT == Q4K ? cf[e % 2].scale_lo * dot[e] : dot[e];
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const Coefs &ce = cf[e % 2];
                        const float du = dr[mt][e / 2];
                        float v = acc[s][mt][nt][e];
                        v = __fmaf_rn(__fmul_rn(ce.coef, du), DT == Q6K ? __int2float_rn(c[e]) : small_int_to_float(c[e]), v);
                        if (DT == Q4_1 || DT == Q4K)
                            v = __fmaf_rn(__fmul_rn(ce.min_coef, du), small_int_to_float(ce.min_mult * sr[mt][e / 2]), v);
                        acc[s][mt][nt][e] = v;
                    }
                }
            }
        }
    }
    __syncthreads();  // every warp is done with the stage: its memory now holds the warps' sums
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                // Offsets 16 and 8: slots (w, w + 16) and (w + 8, w + 24), then the two sums.
                const float s2 = __fadd_rn(__fadd_rn(acc[0][mt][nt][e], acc[2][mt][nt][e]),
                                           __fadd_rn(acc[1][mt][nt][e], acc[3][mt][nt][e]));
                const int r = 16 * mt + g + 8 * (e / 2), c = 8 * nt + 2 * t + e % 2;
                part[(r * MMA_COLS + c) * (MMA_WARPS + 1) + warp] = s2;
            }
    __syncthreads();
    for (int o = threadIdx.x; o < MMA_ROWS * MMA_COLS; o += THREADS) {
        const float *p = part + o * (MMA_WARPS + 1);
        // Offsets 4, 2, 1 over the 8 warps' sums.
        const float s3_0 = __fadd_rn(p[0], p[4]), s3_1 = __fadd_rn(p[1], p[5]);
        const float s3_2 = __fadd_rn(p[2], p[6]), s3_3 = __fadd_rn(p[3], p[7]);
        const float s = __fadd_rn(__fadd_rn(s3_0, s3_2), __fadd_rn(s3_1, s3_3));
        const int r = o / MMA_COLS, c = o % MMA_COLS;
        if (row0 + r < rows && col0 + c < n) y[(size_t)(row0 + r) * n + col0 + c] = s;
    }
}

#define MMA(NAME, DT)                                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * LANES, 2)                           \
        canonical_mma_##NAME(const uint8_t *w, const int8_t *q, const float *d, float *y, int n,  \
                             int k, int rows) {                                                  \
        canonical_mma<DT>(w, q, d, y, n, k, rows);                                               \
    }
MMA(q4_0, Q4_0)
MMA(q4_1, Q4_1)
MMA(q5_0, Q5_0)
MMA(q8_0, Q8_0)
MMA(q4k, Q4K)
MMA(q6k, Q6K)

#define DENSE(R)                                                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * LANES)                                  \
        canonical_f32_r##R(const float *w, const float *x, float *y, int n, int k, int rows) {   \
        canonical_dense<R>(w, x, y, n, k, rows);                                                 \
    }
DENSE(1) DENSE(2) DENSE(4) DENSE(8)
