"""Which list each op kind is on, per device: PyTorch autocast's policy as a table.

* ``whitelist``: autocast's lower-precision list (runs in fp16/bf16 under AMP).
* ``blacklist``: autocast's FP32 lists, including the ``fp32_set_opt_dtype`` ops
  (softmax, sum, cumsum, ...) that autocast runs in FP32 by passing ``dtype=``.
* ``other``: every other numerical op (relu, gelu, add, dropout, pooling, norms
  on CPU, ...). Under autocast these run in whatever dtype reaches them.

Source: ``aten/src/ATen/autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten,
Autocast<Device>, m)`` blocks) and ``autocast_mode.h``; kinds are the
normalised names from :func:`compfx.opkey.normalize_kind`.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["CATEGORIES", "AUTOCAST_POLICY", "classify"]

CATEGORIES = ("whitelist", "blacklist", "other")


def _kinds(text: str) -> frozenset[str]:
    return frozenset(text.split())


# CUDA (and the other GPU-like backends that share its policy: xpu, mps, hpu).
_CUDA_LOWER = _kinds("""
    conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution
    prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    scaled_dot_product_attention multi_head_attention
""")
_CUDA_FP32 = _kinds("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
    layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
    l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
    soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
    dist pdist cdist renorm logsumexp upsample_nearest1d upsample_nearest2d upsample_nearest3d
    upsample_bilinear2d upsample_trilinear3d upsample_bicubic2d upsample_linear1d
    cross_entropy cross_entropy_loss
    prod softmax log_softmax cumprod cumsum linalg_vector_norm sum norm
""")

# CPU.
_CPU_LOWER = _kinds("""
    conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear convolution matmul
    conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu
    scaled_dot_product_attention multi_head_attention
""")
_CPU_FP32 = _kinds("""
    avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist trace
    view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse
    max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d
    replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss
    nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy
    cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits
    fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2
    fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank
    linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
    linalg_householder_product linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine
    geqrf lu_with_info qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d
    adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd
    linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex
""")

#: device type -> (whitelist kinds, blacklist kinds)
AUTOCAST_POLICY: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cuda": (_CUDA_LOWER, _CUDA_FP32),
    "cpu": (_CPU_LOWER, _CPU_FP32),
}


def classify(kind: str, device_type: str, overrides: Mapping[str, str] | None = None) -> str:
    """Category of ``kind`` on ``device_type``; ``overrides`` (kind -> category) win.

    >>> classify("linear", "cuda"), classify("softmax", "cuda"), classify("relu", "cuda")
    ('whitelist', 'blacklist', 'other')
    >>> classify("softmax", "cpu")  # CPU autocast keeps softmax in the input dtype
    'other'
    >>> classify("relu", "cpu", overrides={"relu": "blacklist"})
    'blacklist'
    """
    if overrides and kind in overrides:
        category = overrides[kind]
        if category not in CATEGORIES:
            raise ValueError(f"override for {kind!r} is {category!r}; expected one of {CATEGORIES}")
        return category
    lower, fp32 = AUTOCAST_POLICY.get(device_type, AUTOCAST_POLICY["cuda"])
    if kind in lower:
        return "whitelist"
    if kind in fp32:
        return "blacklist"
    return "other"
