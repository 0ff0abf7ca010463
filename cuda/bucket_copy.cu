// Bucket copies: many (source, destination) pairs in one launch, casting between fp32, bf16 and fp16.
//
// Reference (must match): zero_strategy/kernels/reference.py::flatten_into / unflatten_from, i.e.
//   dst.copy_(src) for each pair (torch's rounding: round to nearest even, NaN -> canonical NaN for bf16).
// flatten_into packs tensors into slices of one flat buffer, unflatten_from copies the slices back;
// both are this kernel with the roles swapped. Same-dtype pairs copy bits unchanged.
#include "zs_common.cuh"

enum { COPY_SRC, COPY_DST, COPY_ROLES };

template <typename S, typename D>
__global__ void __launch_bounds__(256) copy_cast(const i64* table, int n, i64 chunk) {
  const TensorList list{table, n, COPY_ROLES, 0};
  const int t = list.tensor_of(blockIdx.x);
  const i64 numel = list.numel(t);
  const i64 begin = (blockIdx.x - list.first_block()[t]) * chunk;
  const i64 end = begin + chunk < numel ? begin + chunk : numel;
  const bool vec = list.flags(t) & FLAG_VEC;
  const S* src = list.ptr<const S>(COPY_SRC, t);
  D* dst = list.ptr<D>(COPY_DST, t);
  for (i64 i = begin + 4 * (i64)threadIdx.x; i < end; i += 4 * (i64)blockDim.x) {
    if constexpr (same_type<S, D>::value) {
      if (vec && i + 4 <= end) {
        *reinterpret_cast<Vec4<D>*>(dst + i) = *reinterpret_cast<const Vec4<S>*>(src + i);
      } else {
        for (int k = 0; k < 4 && i + k < end; ++k) dst[i + k] = src[i + k];
      }
    } else {
      float v[4];
      load4(src, i, end, vec, v);
      store4(dst, i, end, vec, v);
    }
  }
}

#define ZS_COPY(S, D) template __global__ void copy_cast<S, D>(const i64*, int, i64);
ZS_COPY(float, float) ZS_COPY(float, bf16_t) ZS_COPY(float, f16_t)
ZS_COPY(bf16_t, float) ZS_COPY(bf16_t, bf16_t) ZS_COPY(bf16_t, f16_t)
ZS_COPY(f16_t, float) ZS_COPY(f16_t, bf16_t) ZS_COPY(f16_t, f16_t)
