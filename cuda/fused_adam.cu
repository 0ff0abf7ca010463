// Fused Adam / AdamW over a list of fp32 tensors, one launch, one pass over memory.
//
// Reference (must match): zero_strategy/kernels/reference.py::adam_step, which mirrors
// torch.optim.Adam / AdamW (fp32, amsgrad=False, capturable=False), per element:
//   g  = grad * grad_scale                      (grad fp32, bf16 or fp16; converted in registers)
//   g  = -g                                     if maximize
//   p  = p * (1 - lr * weight_decay)            AdamW (decoupled), or
//   g  = g + weight_decay * p                   Adam
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p  = p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps)
//   out = lowp(p)                               optional bf16/fp16 copy for the all-gather
// with per-tensor step_size = lr / (1 - beta1^step) and bias_correction2_sqrt = sqrt(1 - beta2^step)
// (each tensor has its own step count), computed on the host in float64 like torch.
// Traffic per element: read p, m, v (12 B) and g (2-4 B); write p, m, v (12 B) and out (0-2 B): 26-30 B.
#include "zs_common.cuh"

// Roles of the tensor-list table (see [Note: tensor-list table]) and its per-tensor scalars.
enum { ADAM_PARAM, ADAM_GRAD, ADAM_EXP_AVG, ADAM_EXP_AVG_SQ, ADAM_OUT, ADAM_ROLES };
enum { ADAM_STEP_SIZE, ADAM_BC2_SQRT, ADAM_SCALARS };

// torch's lerp: the two-sided formula keeps the result exact at weight 0 and 1.
__device__ __forceinline__ float lerp_like_torch(float start, float end, float weight) {
  return fabsf(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

// G: gradient storage (float, bf16_t, f16_t). L: low-precision output (bf16_t, f16_t, or no_out_t).
// grad_scale_ptr: optional device float multiplied into grad_scale (e.g. a clip coefficient), or null.
template <typename G, typename L>
__global__ void __launch_bounds__(256) adam_step(
    const i64* table, int n, i64 chunk, float grad_scale, const float* grad_scale_ptr, float one_minus_beta1,
    float beta2, float one_minus_beta2, float eps, float weight_decay, float decay_factor, int decoupled,
    int maximize) {
  const TensorList list{table, n, ADAM_ROLES, ADAM_SCALARS};
  const int t = list.tensor_of(blockIdx.x);
  const i64 numel = list.numel(t);
  const i64 begin = (blockIdx.x - list.first_block()[t]) * chunk;
  const i64 end = begin + chunk < numel ? begin + chunk : numel;
  const bool vec = list.flags(t) & FLAG_VEC;
  float* param = list.ptr<float>(ADAM_PARAM, t);
  const G* grad = list.ptr<const G>(ADAM_GRAD, t);
  float* exp_avg = list.ptr<float>(ADAM_EXP_AVG, t);
  float* exp_avg_sq = list.ptr<float>(ADAM_EXP_AVG_SQ, t);
  L* out = list.ptr<L>(ADAM_OUT, t);
  const float step_size = (float)list.scalar(ADAM_STEP_SIZE, t);
  const float bc2_sqrt = (float)list.scalar(ADAM_BC2_SQRT, t);
  const float scale = grad_scale_ptr ? grad_scale * *grad_scale_ptr : grad_scale;

  for (i64 i = begin + 4 * (i64)threadIdx.x; i < end; i += 4 * (i64)blockDim.x) {
    float p[4], g[4], m[4], v[4];
    load4(param, i, end, vec, p);
    load4(grad, i, end, vec, g);
    load4(exp_avg, i, end, vec, m);
    load4(exp_avg_sq, i, end, vec, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float gk = g[k] * scale;
      if (maximize) gk = -gk;
      if (weight_decay != 0.0f) {
        if (decoupled) p[k] = p[k] * decay_factor;
        else gk = gk + weight_decay * p[k];
      }
      m[k] = lerp_like_torch(m[k], gk, one_minus_beta1);
      v[k] = v[k] * beta2 + one_minus_beta2 * gk * gk;
      const float denom = sqrtf(v[k]) / bc2_sqrt + eps;
      p[k] = p[k] + (-step_size) * m[k] / denom;
    }
    store4(param, i, end, vec, p);
    store4(exp_avg, i, end, vec, m);
    store4(exp_avg_sq, i, end, vec, v);
    if constexpr (!same_type<L, no_out_t>::value) store4(out, i, end, vec, p);
  }
}

// Every combination, so that nvcc checks them all; CuPy looks them up by these names.
#define ZS_ADAM(G, L)                                                                                     \
  template __global__ void adam_step<G, L>(const i64*, int, i64, float, const float*, float, float, float, \
                                           float, float, float, int, int);
ZS_ADAM(float, no_out_t) ZS_ADAM(float, bf16_t) ZS_ADAM(float, f16_t)
ZS_ADAM(bf16_t, no_out_t) ZS_ADAM(bf16_t, bf16_t) ZS_ADAM(bf16_t, f16_t)
ZS_ADAM(f16_t, no_out_t) ZS_ADAM(f16_t, bf16_t) ZS_ADAM(f16_t, f16_t)
