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

// The hyperparameters of one block's tensor, and the update of one element (both loop parts use it).
struct AdamArgs {
  float scale, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, step_size, bc2_sqrt;
  int decoupled, maximize;
};

__device__ __forceinline__ void adam_update(const AdamArgs& a, float& p, float g, float& m, float& v) {
  float gk = g * a.scale;
  if (a.maximize) gk = -gk;
  if (a.weight_decay != 0.0f) {
    if (a.decoupled) p = p * a.decay_factor;
    else gk = gk + a.weight_decay * p;
  }
  m = lerp_like_torch(m, gk, a.one_minus_beta1);
  v = v * a.beta2 + a.one_minus_beta2 * gk * gk;
  const float denom = sqrtf(v) / a.bc2_sqrt + a.eps;
  p = p + (-a.step_size) * m / denom;
}

// G: gradient storage (float, bf16_t, f16_t). L: low-precision output (bf16_t, f16_t, or no_out_t).
// grad_scale, grad_scale_ptr: the gradient factor, see grad_factor in zs_common.cuh.
// The loop: [Note: element loops] in cuda/zs_common.cuhhh.
template <typename G, typename L>
__global__ void __launch_bounds__(256, ZS_MIN_BLOCKS) adam_step(
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
  const AdamArgs a{grad_factor(grad_scale, grad_scale_ptr),
                   one_minus_beta1,
                   beta2,
                   one_minus_beta2,
                   eps,
                   weight_decay,
                   decay_factor,
                   (float)list.scalar(ADAM_STEP_SIZE, t),
                   (float)list.scalar(ADAM_BC2_SQRT, t),
                   decoupled,
                   maximize};

  const i64 stride = 4 * (i64)blockDim.x;
  i64 i = begin + 4 * (i64)threadIdx.x;
  if (vec) {
    for (; i + (ZS_ILP - 1) * stride + 4 <= end; i += ZS_ILP * stride) {
      Vec4<float> pv[ZS_ILP], mv[ZS_ILP], vv[ZS_ILP];
      Vec4<G> gv[ZS_ILP];
#pragma unroll
      for (int u = 0; u < ZS_ILP; ++u) {
        pv[u] = load_vec(param, i + u * stride);
        gv[u] = load_vec(grad, i + u * stride);
        mv[u] = load_vec(exp_avg, i + u * stride);
        vv[u] = load_vec(exp_avg_sq, i + u * stride);
      }
#pragma unroll
      for (int u = 0; u < ZS_ILP; ++u) {
        float p[4], g[4], m[4], v[4];
        to_floats(pv[u], p);
        to_floats(gv[u], g);
        to_floats(mv[u], m);
        to_floats(vv[u], v);
#pragma unroll
        for (int k = 0; k < 4; ++k) adam_update(a, p[k], g[k], m[k], v[k]);
        store_vec(param, i + u * stride, p);
        store_vec(exp_avg, i + u * stride, m);
        store_vec(exp_avg_sq, i + u * stride, v);
        if constexpr (!same_type<L, no_out_t>::value) store_vec(out, i + u * stride, p);
      }
    }
  }
  for (; i < end; i += stride) {
    float p[4], g[4], m[4], v[4];
    load4(param, i, end, vec, p);
    load4(grad, i, end, vec, g);
    load4(exp_avg, i, end, vec, m);
    load4(exp_avg_sq, i, end, vec, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) adam_update(a, p[k], g[k], m[k], v[k]);
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
