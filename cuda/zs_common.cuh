// Shared by every cuda/*.cu: storage types, conversions, and the tensor-list table.
//
// Compiled both by nvcc (tests/test_cuda_sources.py) and by NVRTC through CuPy (zero_strategy/kernels),
// so it includes no header at all: NVRTC has no standard library and cuda_bf16.h/cuda_fp16.h are not
// always on its include path. bf16 is converted with bit operations, fp16 with one PTX instruction.
#pragma once

typedef long long i64;

// 16-bit storage types: a struct per format so templates can tell bf16 from fp16 apart.
struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };
// Tag for "no low-precision output".
struct no_out_t { unsigned short bits; };

__device__ __forceinline__ bool is_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((unsigned)x.bits) << 16); }
__device__ __forceinline__ float to_float(f16_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
// Round to nearest even, NaN -> 0x7FC0: the same bits as torch's float -> bfloat16 conversion.
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{(unsigned short)(u >> 16)};
}
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return f16_t{h};
}

// The gradient factor of the optimizer steps (GradScale in zero_strategy/kernels/reference.py): a host
// float times an optional device scalar, so that a factor computed on the device (the clip coefficient
// over the loss scale) is applied without a host sync. grad_scale_ptr: a device float, or null.
__device__ __forceinline__ float grad_factor(float grad_scale, const float* grad_scale_ptr) {
  return grad_scale_ptr ? grad_scale * *grad_scale_ptr : grad_scale;
}

// Four consecutive elements, aligned so that one vector instruction moves them (16 B for fp32, 8 B for 16-bit).
template <typename T> struct alignas(4 * sizeof(T)) Vec4 { T v[4]; };

// Load elements [i, i + 4) of p (those below n; the rest read as zero) as floats. `vec` says that p is
// aligned for Vec4 loads (i is always a multiple of 4).
template <typename T>
__device__ __forceinline__ void load4(const T* p, i64 i, i64 n, bool vec, float out[4]) {
  if (vec && i + 4 <= n) {
    Vec4<T> x = *reinterpret_cast<const Vec4<T>*>(p + i);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = to_float(x.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = i + k < n ? to_float(p[i + k]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* p, i64 i, i64 n, bool vec, const float in[4]) {
  if (vec && i + 4 <= n) {
    Vec4<T> x;
#pragma unroll
    for (int k = 0; k < 4; ++k) x.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<Vec4<T>*>(p + i) = x;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i + k < n) p[i + k] = from_float<T>(in[k]);
  }
}

// [Note: element loops]
// A block's chunk is [begin, end); thread x owns the Vec4s at begin + 4 * x + j * stride, stride = 4 * blockDim.x,
// j = 0, 1, ... Memory-bound kernels need many bytes in flight per thread, so the loop has two parts:
//   fast path (every array of the tensor Vec4-aligned): ZS_ILP of the thread's Vec4s at once, while all of
//     them lie below end: first every load of the ZS_ILP vectors, then the arithmetic, then every store;
//   rest (unaligned tensors, and the chunk's tail): the thread's remaining Vec4s one at a time through
//     load4/store4, which read and write only the elements below end.
// The fast path leaves i at the thread's first Vec4 it did not do, so the rest continues from there; every
// element is computed by the same per-element function in both parts, in the same order per thread.
#ifndef ZS_ILP
#define ZS_ILP 4
#endif
// Blocks of 256 threads per SM that the element kernels' registers must allow (__launch_bounds__).
#ifndef ZS_MIN_BLOCKS
#define ZS_MIN_BLOCKS 2
#endif

// One Vec4 of p at element i (p + i aligned for Vec4), raw: converted after every load is issued.
template <typename T> __device__ __forceinline__ Vec4<T> load_vec(const T* p, i64 i) {
  return *reinterpret_cast<const Vec4<T>*>(p + i);
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, i64 i, const float in[4]) {
  Vec4<T> x;
#pragma unroll
  for (int k = 0; k < 4; ++k) x.v[k] = from_float<T>(in[k]);
  *reinterpret_cast<Vec4<T>*>(p + i) = x;
}
template <typename T> __device__ __forceinline__ void to_floats(const Vec4<T>& x, float out[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = to_float(x.v[k]);
}

// [Note: tensor-list table]
// A launch covers many tensors (the engine's pieces), none of them flattened. The host packs one int64
// table, copied to the device once per launch, with n = number of tensors and `roles` pointer rows:
//   row r < roles      address of tensor t's array for role r (param, grad, exp_avg, ...; 0 = absent)
//   row roles          numel of tensor t
//   row roles + 1      flags of tensor t (bit 0: every array is Vec4-aligned; bit 1: first step)
//   rows roles + 2 ... per-tensor scalars, float64 bits (`scalars` rows)
//   last row, n + 1    first block of tensor t (prefix sum of ceil(numel / chunk)); [n] = grid size
// Block b works on elements [c * chunk, (c + 1) * chunk) of tensor t, where t is the last tensor whose
// first block is <= b and c = b - first block of t. Tensors of size 0 own no block.
struct TensorList {
  const i64* table;
  int n, roles, scalars;

  __device__ __forceinline__ const i64* row(int r) const { return table + (i64)r * n; }
  template <typename T> __device__ __forceinline__ T* ptr(int role, int t) const {
    return reinterpret_cast<T*>(row(role)[t]);
  }
  __device__ __forceinline__ i64 numel(int t) const { return row(roles)[t]; }
  __device__ __forceinline__ i64 flags(int t) const { return row(roles + 1)[t]; }
  __device__ __forceinline__ double scalar(int s, int t) const { return __longlong_as_double(row(roles + 2 + s)[t]); }
  __device__ __forceinline__ const i64* first_block() const { return row(roles + 2 + scalars); }

  // The tensor that block b works on: binary search over first_block (every thread, same addresses).
  __device__ __forceinline__ int tensor_of(i64 b) const {
    const i64* first = first_block();
    int lo = 0, hi = n - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) / 2;
      if (first[mid] <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
};

constexpr i64 FLAG_VEC = 1;
constexpr i64 FLAG_FIRST_STEP = 2;
