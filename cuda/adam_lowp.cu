// Adam / AdamW with low-precision state: block-wise int8 moments (or bf16 moments with stochastic
// rounding), and fp32 or bf16 master weights (bf16 with stochastic rounding), one pass over memory.
//
// Reference (must match): zero_strategy/kernels/reference.py::adam_lowp_step, which decodes the stored
// state into fp32, runs reference.adam_step (torch's single-tensor Adam, element by element as
// fused_adam.cu does) and encodes the result, per element and per block of QBLOCK elements:
//   m, v  = decode(m), decode(v)                int8: code_map[code] * block scale; bf16: widened
//   p     = decode(p)                           fp32 as is, bf16 widened
//   (p, m, v) = adam_update(p, g, m, v)         as fused_adam.cu (torch's order of operations)
//   m, v  = encode(m), encode(v)                int8: scale = the block's largest |value|, code =
//                                               the number of code midpoints below value / scale;
//                                               bf16: stochastic rounding, see below
//   p     = encode(p)                           bf16 masters: stochastic rounding
// The encodings are those of zero_strategy/engine/optim/lowp.py ([Note: int8 state], [Note: stochastic
// rounding]): the code map and its midpoints come from the host (the same fp32 values), and the random
// bits of stochastic rounding are splitmix64(seed, step, key, position), so a position rounds the same
// way in this kernel and in torch, at any world size.
// Traffic per element with int8 moments and bf16 masters: read p (2 B), g (2-4 B), m, v (2 B and
// 8/QBLOCK B of scales); write the same: 10-12 B against fused_adam.cu's 26-30 B.
#include "zs_common.cuh"

#define QBLOCK 256  // elements per int8 block = threads per CUDA block; one CUDA block per int8 block

// Roles of the tensor-list table (see [Note: tensor-list table] in cuda/zs_common.cuhhh). KEY and START are
// not addresses: the parameter's stochastic-rounding key and the position of the tensor's first
// element in its parameter (engine/optim/lowp.py's random_bits16).
enum { LP_PARAM, LP_GRAD, LP_EXP_AVG, LP_EXP_AVG_SQ, LP_AVG_SCALE, LP_AVG_SQ_SCALE, LP_KEY, LP_START, LP_ROLES };
enum { LP_STEP_SIZE, LP_BC2_SQRT, LP_SCALARS };

// Storage tags: int8 codes with a scale per block, or bf16.
struct q8_t { unsigned char bits; };

__device__ __forceinline__ float lerp_like_torch(float start, float end, float weight) {
  return fabsf(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

// splitmix64 of (seed, step, key, position): 16 random bits, as random_bits16 in engine/optim/lowp.py.
__device__ __forceinline__ unsigned random_bits16(unsigned long long base, unsigned long long position) {
  unsigned long long z = position * 0x9E3779B97F4A7C15ull + base;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z = z ^ (z >> 31);
  return (unsigned)((z >> 40) & 0xFFFFull);
}

// Stochastic rounding of x to bf16 with 16 random bits; infinities and NaNs round to nearest.
__device__ __forceinline__ bf16_t round_stochastic(float x, unsigned bits16) {
  const unsigned u = __float_as_uint(x);
  const unsigned r = (u + bits16) & 0xFFFF0000u;
  if (!is_finite(x) || !is_finite(__uint_as_float(r))) return from_float<bf16_t>(x);
  return bf16_t{(unsigned short)(r >> 16)};
}

// The block's largest |x| over its QBLOCK threads (every thread gets it).
__device__ __forceinline__ float block_absmax(float x, float* shared) {
  float a = fabsf(x);
  for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = a;
  __syncthreads();
  a = threadIdx.x < QBLOCK / 32 ? shared[threadIdx.x] : 0.0f;
  if (threadIdx.x < 32)
    for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
  if (threadIdx.x == 0) shared[0] = a;
  __syncthreads();
  a = shared[0];
  __syncthreads();  // shared is reused by the next reduction
  return a;
}

// The code of x / scale: how many of the 255 midpoints lie strictly below it (torch.bucketize).
__device__ __forceinline__ unsigned char encode_code(float normal, const float* midpoints) {
  int lo = 0, hi = 255;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (midpoints[mid] < normal) lo = mid + 1; else hi = mid;
  }
  return (unsigned char)lo;
}

// S: the moments' storage (q8_t or bf16_t). P: the master's (float or bf16_t). G: the gradient's.
// code_maps: the signed then the unsigned map (256 floats each); midpoints: theirs (255 each).
// base: the stochastic-rounding base of this step (seed and step mixed, see engine/optim/lowp.py).
template <typename G, typename S, typename P>
__global__ void __launch_bounds__(QBLOCK) adam_lowp_step(
    const i64* table, int n, float grad_scale, const float* grad_scale_ptr, const float* code_maps,
    const float* midpoints, unsigned long long seed_step, float one_minus_beta1, float beta2,
    float one_minus_beta2, float eps, float weight_decay, float decay_factor, int decoupled, int maximize) {
  __shared__ float reduce[QBLOCK / 32];
  const TensorList list{table, n, LP_ROLES, LP_SCALARS};
  const int t = list.tensor_of(blockIdx.x);
  const i64 numel = list.numel(t);
  const i64 first = (blockIdx.x - list.first_block()[t]) * (i64)QBLOCK;
  const i64 i = first + threadIdx.x;
  const bool live = i < numel;
  const unsigned long long key = (unsigned long long)list.row(LP_KEY)[t];
  const unsigned long long position = (unsigned long long)(list.row(LP_START)[t] + i);
  const unsigned long long base = seed_step ^ (key * 0x85EBCA77ull);

  P* param = list.ptr<P>(LP_PARAM, t);
  const G* grad = list.ptr<const G>(LP_GRAD, t);
  S* exp_avg = list.ptr<S>(LP_EXP_AVG, t);
  S* exp_avg_sq = list.ptr<S>(LP_EXP_AVG_SQ, t);
  float* avg_scale = list.ptr<float>(LP_AVG_SCALE, t);
  float* avg_sq_scale = list.ptr<float>(LP_AVG_SQ_SCALE, t);
  const i64 qblock = first / QBLOCK;

  float p = 0.0f, g = 0.0f, m = 0.0f, v = 0.0f;
  if (live) {
    p = to_float(param[i]);
    g = to_float(grad[i]);
    if constexpr (same_type<S, q8_t>::value) {
      m = code_maps[exp_avg[i].bits] * avg_scale[qblock];
      v = code_maps[256 + exp_avg_sq[i].bits] * avg_sq_scale[qblock];
    } else {
      m = to_float(exp_avg[i]);
      v = to_float(exp_avg_sq[i]);
    }
    // the update of fused_adam.cu's adam_update, in torch's order
    float gk = g * grad_factor(grad_scale, grad_scale_ptr);
    if (maximize) gk = -gk;
    if (weight_decay != 0.0f) {
      if (decoupled) p = p * decay_factor;
      else gk = gk + weight_decay * p;
    }
    m = lerp_like_torch(m, gk, one_minus_beta1);
    v = v * beta2 + one_minus_beta2 * gk * gk;
    const float denom = sqrtf(v) / (float)list.scalar(LP_BC2_SQRT, t) + eps;
    p = p + (-(float)list.scalar(LP_STEP_SIZE, t)) * m / denom;
  }
  if constexpr (same_type<S, q8_t>::value) {  // every thread of the block reaches the reductions
    const float m_scale = block_absmax(live ? m : 0.0f, reduce);
    const float v_scale = block_absmax(live ? v : 0.0f, reduce);
    if (live) {
      exp_avg[i].bits = encode_code(m / (m_scale > 0.0f ? m_scale : 1.0f), midpoints);
      exp_avg_sq[i].bits = encode_code(v / (v_scale > 0.0f ? v_scale : 1.0f), midpoints + 255);
    }
    if (threadIdx.x == 0) {
      avg_scale[qblock] = m_scale;
      avg_sq_scale[qblock] = v_scale;
    }
  } else if (live) {
    // each state tensor of a parameter draws its own bits: slot 0 the master, 1 and 2 the moments
    exp_avg[i] = round_stochastic(m, random_bits16(base ^ 1ull, position));
    exp_avg_sq[i] = round_stochastic(v, random_bits16(base ^ 2ull, position));
  }
  if (live) {
    if constexpr (same_type<P, bf16_t>::value) param[i] = round_stochastic(p, random_bits16(base, position));
    else param[i] = p;
  }
}

// Every combination, so that nvcc checks them all; CuPy looks them up by these names.
#define ZS_ADAM_LOWP(G, S, P)                                                                            \
  template __global__ void adam_lowp_step<G, S, P>(const i64*, int, float, const float*, const float*,  \
                                                   const float*, unsigned long long, float, float, float, \
                                                   float, float, float, int, int);
ZS_ADAM_LOWP(float, q8_t, float) ZS_ADAM_LOWP(float, q8_t, bf16_t) ZS_ADAM_LOWP(float, bf16_t, float)
ZS_ADAM_LOWP(float, bf16_t, bf16_t) ZS_ADAM_LOWP(bf16_t, q8_t, float) ZS_ADAM_LOWP(bf16_t, q8_t, bf16_t)
ZS_ADAM_LOWP(bf16_t, bf16_t, float) ZS_ADAM_LOWP(bf16_t, bf16_t, bf16_t)
