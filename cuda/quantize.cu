// Block-wise int8/int4 quantization of packed rows, for communication (quantized_weights,
// quantized_gradients).
//
// Reference (must match): zero_strategy/engine/comm/quantize.py (reference_quantize_rows,
// reference_dequantize_rows, reference_dequantize_sum), where [Note: packed rows] defines a row:
//   [ codes: ceil(L * BITS / 8) bytes, zero-padded to a multiple of 4 | scales: nblocks x fp32 ]
// for a row of L elements cut into blocks of `block` elements. scale = absmax / qmax (qmax 127 or 7),
// code = clamp(rint(x / scale), -qmax, qmax), 0 in a block of zeros; int4 codes are stored as code + 8,
// element 2i in the low nibble of byte i. A block holding a NaN or an infinity gets that as its scale
// (NaN first, as torch's amax) and codes 0, so every value dequantized from it is non-finite: an fp16
// overflow still reaches the loss scaler after the reduction.
//
// Four kernels, each one pass:
//   quant_scales<T>          one CUDA block per (row, quantization block): the scale
//   quant_codes<T, BITS>     one thread per code byte of every row: reads its block's scale, writes the byte
//   dequant_rows<O, BITS>    one thread per element: code * scale in fp32, stored as O into a
//                            strided output (the gathered buffer itself: the copy-out is fused)
//   dequant_sum<BITS>        one thread per element: the sum over rows of code * scale, in fp32, in
//                            row order (what torch's sum over dim 0 of the fp32 rows gives)
// Stochastic rounding (gradients) replaces rint(v) by floor(v + u), u uniform in [0, 1) from a hash of
// (seed, row, element): a device int64 seed, drawn by the caller from its generator, so no host sync.
#include "zs_common.cuh"

constexpr int Q_THREADS = 256;

// NaN wins, then the larger magnitude: torch's amax of |x| over a block.
__device__ __forceinline__ float nan_max(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

__device__ __forceinline__ float block_nan_max(float x) {
  __shared__ float warp_results[32];
  __shared__ float result;
  for (int offset = 16; offset > 0; offset /= 2) x = nan_max(x, __shfl_down_sync(0xffffffffu, x, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < (int)(blockDim.x / 32) ? warp_results[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) x = nan_max(x, __shfl_down_sync(0xffffffffu, x, offset));
    if (lane == 0) result = x;
  }
  __syncthreads();
  return result;
}

// splitmix64 of (seed, index): 24 uniform bits as a float in [0, 1).
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long index) {
  unsigned long long z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ const float* row_scales(const unsigned char* row, i64 codes_len) {
  return reinterpret_cast<const float*>(row + codes_len);
}

// Block blockIdx.x = row * nblocks + b writes the scale of block b of that row.
template <typename T>
__global__ void __launch_bounds__(Q_THREADS) quant_scales(const T* x, i64 numel, i64 block, i64 nblocks, int qmax,
                                                          unsigned char* out, i64 row_bytes, i64 codes_len) {
  const i64 row = blockIdx.x / nblocks, b = blockIdx.x % nblocks;
  const T* xr = x + row * numel;
  const i64 begin = b * block, end = begin + block < numel ? begin + block : numel;
  float m = 0.0f;
  for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) m = nan_max(m, fabsf(to_float(xr[i])));
  m = block_nan_max(m);
  if (threadIdx.x == 0)
    reinterpret_cast<float*>(out + row * row_bytes + codes_len)[b] = m / (float)qmax;
}

template <int BITS>
__device__ __forceinline__ int quantize_one(float v, float scale, int qmax, const i64* seed, i64 row, i64 i,
                                            i64 numel) {
  if (!(scale > 0.0f) || !is_finite(scale)) return 0;  // a block of zeros, or a non-finite one
  float q = v / scale;
  q = seed ? floorf(q + uniform01((unsigned long long)seed[0], (unsigned long long)(row * numel + i))) : rintf(q);
  q = fminf(fmaxf(q, (float)-qmax), (float)qmax);
  return (int)q;
}

// Thread k writes code byte j = k % codes_len of row k / codes_len: element j (int8) or elements 2j,
// 2j + 1 (int4), or a zero of the padding up to codes_len.
template <typename T, int BITS>
__global__ void __launch_bounds__(Q_THREADS) quant_codes(const T* x, i64 rows, i64 numel, i64 block, int qmax,
                                                         const i64* seed, unsigned char* out, i64 row_bytes,
                                                         i64 codes_len) {
  const i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= rows * codes_len) return;
  const i64 row = k / codes_len, j = k % codes_len;
  const T* xr = x + row * numel;
  unsigned char* o = out + row * row_bytes;
  const float* scales = row_scales(o, codes_len);
  if (BITS == 8) {
    o[j] = j < numel ? (unsigned char)(signed char)quantize_one<8>(to_float(xr[j]), scales[j / block], qmax, seed, row,
                                                                   j, numel)
                     : 0;
  } else {
    if (2 * j >= numel) {
      o[j] = 0;
      return;
    }
    const int low = quantize_one<4>(to_float(xr[2 * j]), scales[(2 * j) / block], qmax, seed, row, 2 * j, numel);
    const int high = quantize_one<4>(to_float(xr[2 * j + 1]), scales[(2 * j + 1) / block], qmax, seed, row, 2 * j + 1,
                                     numel);
    o[j] = (unsigned char)((low + 8) | ((high + 8) << 4));
  }
}

template <int BITS>
__device__ __forceinline__ float dequantize_one(const unsigned char* row, i64 i, i64 block, i64 codes_len) {
  int code;
  if (BITS == 8) {
    code = (signed char)row[i];
  } else {
    const unsigned char pair = row[i / 2];
    code = (int)((i % 2) ? (pair >> 4) : (pair & 0x0F)) - 8;
  }
  return (float)code * row_scales(row, codes_len)[i / block];
}

// out[row * out_stride + i] = code * scale, stored as O (rounded to nearest even for bf16/fp16, as
// torch's copy_ rounds).
template <typename O, int BITS>
__global__ void __launch_bounds__(Q_THREADS) dequant_rows(const unsigned char* packed, i64 rows, i64 numel, i64 block,
                                                          i64 row_bytes, i64 codes_len, O* out, i64 out_stride) {
  const i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= rows * numel) return;
  const i64 row = k / numel, i = k % numel;
  out[row * out_stride + i] = from_float<O>(dequantize_one<BITS>(packed + row * row_bytes, i, block, codes_len));
}

// out[i] = sum over rows of code * scale, in fp32, row 0 first.
template <int BITS>
__global__ void __launch_bounds__(Q_THREADS) dequant_sum(const unsigned char* packed, i64 rows, i64 numel, i64 block,
                                                         i64 row_bytes, i64 codes_len, float* out) {
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= numel) return;
  float acc = 0.0f;
  for (i64 row = 0; row < rows; ++row) acc += dequantize_one<BITS>(packed + row * row_bytes, i, block, codes_len);
  out[i] = acc;
}

template __global__ void quant_scales<float>(const float*, i64, i64, i64, int, unsigned char*, i64, i64);
template __global__ void quant_scales<bf16_t>(const bf16_t*, i64, i64, i64, int, unsigned char*, i64, i64);
template __global__ void quant_scales<f16_t>(const f16_t*, i64, i64, i64, int, unsigned char*, i64, i64);
template __global__ void quant_codes<float, 8>(const float*, i64, i64, i64, int, const i64*, unsigned char*, i64,
                                                   i64);
template __global__ void quant_codes<float, 4>(const float*, i64, i64, i64, int, const i64*, unsigned char*, i64,
                                                   i64);
template __global__ void quant_codes<bf16_t, 8>(const bf16_t*, i64, i64, i64, int, const i64*, unsigned char*, i64,
                                                   i64);
template __global__ void quant_codes<bf16_t, 4>(const bf16_t*, i64, i64, i64, int, const i64*, unsigned char*, i64,
                                                   i64);
template __global__ void quant_codes<f16_t, 8>(const f16_t*, i64, i64, i64, int, const i64*, unsigned char*, i64,
                                                   i64);
template __global__ void quant_codes<f16_t, 4>(const f16_t*, i64, i64, i64, int, const i64*, unsigned char*, i64,
                                                   i64);
template __global__ void dequant_rows<float, 8>(const unsigned char*, i64, i64, i64, i64, i64, float*, i64);
template __global__ void dequant_rows<float, 4>(const unsigned char*, i64, i64, i64, i64, i64, float*, i64);
template __global__ void dequant_rows<bf16_t, 8>(const unsigned char*, i64, i64, i64, i64, i64, bf16_t*, i64);
template __global__ void dequant_rows<bf16_t, 4>(const unsigned char*, i64, i64, i64, i64, i64, bf16_t*, i64);
template __global__ void dequant_rows<f16_t, 8>(const unsigned char*, i64, i64, i64, i64, i64, f16_t*, i64);
template __global__ void dequant_rows<f16_t, 4>(const unsigned char*, i64, i64, i64, i64, i64, f16_t*, i64);
template __global__ void dequant_sum<8>(const unsigned char*, i64, i64, i64, i64, i64, float*);
template __global__ void dequant_sum<4>(const unsigned char*, i64, i64, i64, i64, i64, float*);
