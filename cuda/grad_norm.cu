// Gradient norm and overflow check in one pass over a list of tensors (fp32, bf16 or fp16).
//
// Reference (must match): zero_strategy/kernels/reference.py::grad_norm_and_overflow:
//   total     = sum over all elements of x^2   (norm_type 2), or max |x| (norm_type inf)
//   nonfinite = any element is NaN or +-Inf
// Two kernels: grad_norm_partials writes one partial (and one flag) per block; grad_norm_final, one
// block, reduces the partials in float64 in a fixed order. The grid and every reduction tree depend only
// on the tensor sizes, so the same gradients give the same bits on every run (no atomics).
#include "zs_common.cuh"

enum { NORM_TENSOR, NORM_ROLES };
constexpr int NORM_THREADS = 256;

template <typename T>
__device__ __forceinline__ T combine(T a, T b, bool max_mode) { return max_mode ? (a > b ? a : b) : a + b; }

// Reduce one value per thread to thread 0 (fixed order): warp shuffles, then one warp over the warps.
template <typename T>
__device__ __forceinline__ T block_reduce(T x, bool max_mode) {
  __shared__ T warp_results[32];
  for (int offset = 16; offset > 0; offset /= 2) x = combine(x, __shfl_down_sync(0xffffffffu, x, offset), max_mode);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  x = threadIdx.x < blockDim.x / 32 ? warp_results[lane] : T(0);
  if (warp == 0)
    for (int offset = 16; offset > 0; offset /= 2) x = combine(x, __shfl_down_sync(0xffffffffu, x, offset), max_mode);
  return x;
}

// Block b writes partials[block_offset + b] and flags[block_offset + b]: several launches (one per
// gradient dtype) fill disjoint ranges of the same arrays before grad_norm_final.
// The loop: [Note: element loops] in cuda/zs_common.cuhhh; each thread accumulates its elements in the same order
// (its Vec4s in turn, 4 elements each) on either path.
template <typename G>
__global__ void __launch_bounds__(NORM_THREADS, ZS_MIN_BLOCKS) grad_norm_partials(
    const i64* table, int n, i64 chunk, int max_mode, float* partials, unsigned char* flags, i64 block_offset) {
  const TensorList list{table, n, NORM_ROLES, 0};
  const int t = list.tensor_of(blockIdx.x);
  const i64 numel = list.numel(t);
  const i64 begin = (blockIdx.x - list.first_block()[t]) * chunk;
  const i64 end = begin + chunk < numel ? begin + chunk : numel;
  const bool vec = list.flags(t) & FLAG_VEC;
  const G* x = list.ptr<const G>(NORM_TENSOR, t);
  float acc = 0.0f;
  int bad = 0;
  const i64 stride = 4 * (i64)blockDim.x;
  i64 i = begin + 4 * (i64)threadIdx.x;
  if (vec) {
    for (; i + (ZS_ILP - 1) * stride + 4 <= end; i += ZS_ILP * stride) {
      Vec4<G> xv[ZS_ILP];
#pragma unroll
      for (int u = 0; u < ZS_ILP; ++u) xv[u] = load_vec(x, i + u * stride);
#pragma unroll
      for (int u = 0; u < ZS_ILP; ++u) {
        float v[4];
        to_floats(xv[u], v);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          bad |= !is_finite(v[k]);
          acc = max_mode ? fmaxf(acc, fabsf(v[k])) : acc + v[k] * v[k];
        }
      }
    }
  }
  for (; i < end; i += stride) {
    float v[4];
    load4(x, i, end, vec, v);  // elements past the end read as 0: neutral for both sum and max
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      bad |= !is_finite(v[k]);
      acc = max_mode ? fmaxf(acc, fabsf(v[k])) : acc + v[k] * v[k];
    }
  }
  acc = block_reduce(acc, max_mode);
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    partials[block_offset + blockIdx.x] = acc;
    flags[block_offset + blockIdx.x] = bad ? 1 : 0;
  }
}

// One block: total[0] = sum (or max) of the partials in float64, rounded to float; nonfinite[0] = any flag.
__global__ void __launch_bounds__(NORM_THREADS) grad_norm_final(
    const float* partials, const unsigned char* flags, i64 count, int max_mode, float* total, bool* nonfinite) {
  double acc = 0.0;
  int bad = 0;
  for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
    acc = combine(acc, (double)partials[i], max_mode);
    bad |= flags[i];
  }
  acc = block_reduce(acc, max_mode);
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    total[0] = (float)acc;
    nonfinite[0] = bad != 0;
  }
}

template __global__ void grad_norm_partials<float>(const i64*, int, i64, int, float*, unsigned char*, i64);
template __global__ void grad_norm_partials<bf16_t>(const i64*, int, i64, int, float*, unsigned char*, i64);
template __global__ void grad_norm_partials<f16_t>(const i64*, int, i64, int, float*, unsigned char*, i64);
