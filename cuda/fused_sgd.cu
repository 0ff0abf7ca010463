// Fused SGD (momentum, dampening, Nesterov, weight decay) over a list of fp32 tensors, one launch.
//
// Reference (must match): zero_strategy/kernels/reference.py::sgd_step, which mirrors torch.optim.SGD
// (fp32), per element:
//   g   = grad * grad_scale                       (grad fp32, bf16 or fp16)
//   g   = -g                                      if maximize
//   g   = g + weight_decay * p
//   buf = g  on the tensor's first step, else buf * momentum + (1 - dampening) * g     (momentum != 0)
//   g   = g + momentum * buf  if nesterov, else buf                                    (momentum != 0)
//   p   = p - lr * g
//   out = lowp(p)                                 optional bf16/fp16 copy for the all-gather
// Traffic per element with momentum: read p, buf, g; write p, buf, out: 18-22 B.
#include "zs_common.cuh"

enum { SGD_PARAM, SGD_GRAD, SGD_MOMENTUM_BUFFER, SGD_OUT, SGD_ROLES };

struct SgdArgs {
  float scale, lr, momentum, one_minus_dampening, weight_decay;
  int nesterov, maximize;
};

// One element; b is read only after the first step (and written whenever momentum != 0).
__device__ __forceinline__ void sgd_update(const SgdArgs& a, bool first_step, float& p, float g, float& b) {
  float gk = g * a.scale;
  if (a.maximize) gk = -gk;
  if (a.weight_decay != 0.0f) gk = gk + a.weight_decay * p;
  if (a.momentum != 0.0f) {
    b = first_step ? gk : b * a.momentum + a.one_minus_dampening * gk;
    gk = a.nesterov ? gk + a.momentum * b : b;
  }
  p = p + (-a.lr) * gk;
}

// The loop: [Note: element loops] in cuda/zs_common.cuhhh.
template <typename G, typename L>
__global__ void __launch_bounds__(256, ZS_MIN_BLOCKS) sgd_step(
    const i64* table, int n, i64 chunk, float grad_scale, const float* grad_scale_ptr, float lr, float momentum,
    float one_minus_dampening, float weight_decay, int nesterov, int maximize) {
  const TensorList list{table, n, SGD_ROLES, 0};
  const int t = list.tensor_of(blockIdx.x);
  const i64 numel = list.numel(t);
  const i64 begin = (blockIdx.x - list.first_block()[t]) * chunk;
  const i64 end = begin + chunk < numel ? begin + chunk : numel;
  const bool vec = list.flags(t) & FLAG_VEC;
  const bool first_step = list.flags(t) & FLAG_FIRST_STEP;
  float* param = list.ptr<float>(SGD_PARAM, t);
  const G* grad = list.ptr<const G>(SGD_GRAD, t);
  float* buffer = list.ptr<float>(SGD_MOMENTUM_BUFFER, t);  // null when momentum == 0
  L* out = list.ptr<L>(SGD_OUT, t);
  const SgdArgs a{grad_factor(grad_scale, grad_scale_ptr),
                  lr,
                  momentum,
                  one_minus_dampening,
                  weight_decay,
                  nesterov,
                  maximize};
  const bool read_buffer = momentum != 0.0f && !first_step;

  const i64 stride = 4 * (i64)blockDim.x;
  i64 i = begin + 4 * (i64)threadIdx.x;
  if (vec) {
    for (; i + (ZS_ILP - 1) * stride + 4 <= end; i += ZS_ILP * stride) {
      Vec4<float> pv[ZS_ILP], bv[ZS_ILP];
      Vec4<G> gv[ZS_ILP];
#pragma unroll
      for (int u = 0; u < ZS_ILP; ++u) {
        pv[u] = load_vec(param, i + u * stride);
        gv[u] = load_vec(grad, i + u * stride);
        if (read_buffer) bv[u] = load_vec(buffer, i + u * stride);
      }
#pragma unroll
      for (int u = 0; u < ZS_ILP; ++u) {
        float p[4], g[4], b[4];
        to_floats(pv[u], p);
        to_floats(gv[u], g);
        if (read_buffer) to_floats(bv[u], b);
#pragma unroll
        for (int k = 0; k < 4; ++k) sgd_update(a, first_step, p[k], g[k], b[k]);
        store_vec(param, i + u * stride, p);
        if (momentum != 0.0f) store_vec(buffer, i + u * stride, b);
        if constexpr (!same_type<L, no_out_t>::value) store_vec(out, i + u * stride, p);
      }
    }
  }
  for (; i < end; i += stride) {
    float p[4], g[4], b[4];
    load4(param, i, end, vec, p);
    load4(grad, i, end, vec, g);
    if (read_buffer) load4(buffer, i, end, vec, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) sgd_update(a, first_step, p[k], g[k], b[k]);
    store4(param, i, end, vec, p);
    if (momentum != 0.0f) store4(buffer, i, end, vec, b);
    if constexpr (!same_type<L, no_out_t>::value) store4(out, i, end, vec, p);
  }
}

#define ZS_SGD(G, L) \
  template __global__ void sgd_step<G, L>(const i64*, int, i64, float, const float*, float, float, float, float, int, int);
ZS_SGD(float, no_out_t) ZS_SGD(float, bf16_t) ZS_SGD(float, f16_t)
ZS_SGD(bf16_t, no_out_t) ZS_SGD(bf16_t, bf16_t) ZS_SGD(bf16_t, f16_t)
ZS_SGD(f16_t, no_out_t) ZS_SGD(f16_t, bf16_t) ZS_SGD(f16_t, f16_t)
