"""Which list each op kind is on, per device: PyTorch autocast's policy as a table.

* ``whitelist``: autocast's lower-precision list (runs in fp16/bf16 under AMP).
* ``blacklist``: autocast's FP32 lists, including the ``fp32_set_opt_dtype`` ops
  (softmax, sum, cumsum, ...) that autocast runs in FP32 by passing ``dtype=``.
* ``other``: every other numerical op (relu, gelu, add, dropout, pooling, norms
  on CPU, ...). Under autocast these run in whatever dtype reaches them.

Source: ``aten/src/ATen/autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten,
Autocast<Device>, m)`` blocks) and ``autocast_mode.h``; kinds are the
normalised names from :func:`compfx.opkey.normalize_kind` (leading ``_``
dropped). To extend: add the kind to the device's set below, or pass
``overrides={"kind": "category"}`` to :func:`classify` / ``compfx.analyze``.
Devices without a table of their own (mps, hpu, ...) use CUDA's.

``tests/test_oplists.py`` checks the tables against the dispatcher of the torch
it runs on: every op that has an AutocastCPU or AutocastCUDA kernel with an
FP32 or lower-precision policy must be classified so, or be listed in
:data:`AUTOCAST_EXCEPTIONS` with the reason, so a torch upgrade that registers
an op the tables miss fails that test. Kinds whose registration differs between
the torch versions compfx supports are in :data:`REGISTERED_SINCE`: they are on
a list only where this torch registers their kernel.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

from .vocabulary import Category

__all__ = ["AUTOCAST_POLICY", "AUTOCAST_EXCEPTIONS", "REGISTERED_SINCE", "classify"]


def _kinds(text: str) -> frozenset[str]:
    return frozenset(text.split())


# CUDA. Lower precision: AT_FORALL_LOWER_PRECISION_FP in autocast_mode.h, plus
# cudnn_convolution(_transpose) from autocast_mode.cpp and the cuDNN RNNs, which
# aten/src/ATen/cudnn/AutocastRNN.cpp registers for _cudnn_rnn (gru, lstm, rnn_*).
_CUDA_LOWER = _kinds("""
    convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    cudnn_convolution cudnn_convolution_transpose prelu
    addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot
    thnn_fused_lstm_cell thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    cudnn_rnn lstm gru rnn_tanh rnn_relu
    scaled_dot_product_flash_attention scaled_dot_product_attention
""")
# FP32: AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE (softmax, sum, ... run in
# fp32 via dtype=) and norm (fp32_append_dtype). cross_entropy is composite on
# CUDA (log_softmax + nll_loss), and both halves are on the fp32 list.
_CUDA_FP32 = _kinds("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
    layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
    l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
    soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
    dist pdist cdist renorm logsumexp
    upsample_nearest1d upsample_nearest_exact1d upsample_nearest2d upsample_nearest_exact2d
    upsample_nearest3d upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
    upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d upsample_bicubic2d_aa
    prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum
    norm cross_entropy cross_entropy_loss
""")

# CPU: TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) in autocast_mode.cpp. Unlike
# CUDA, softmax, layer_norm, sum, exp ... are on no list: they run in whatever
# dtype reaches them. nn.LSTM reaches mkldnn_rnn_layer. nn.GRU/nn.RNN have no
# CPU kernel of their own: torch.gru decomposes into linear/mm cells, and
# autocast casts those GEMMs to low precision, so as one captured op the GRU
# runs low under CPU autocast (its output keeps the hidden state's dtype).
_CPU_LOWER = _kinds("""
    conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addmm_activation addbmm linear
    convolution matmul conv_tbc mkldnn_rnn_layer lstm gru rnn_tanh rnn_relu
    conv_transpose1d conv_transpose2d
    conv_transpose3d prelu scaled_dot_product_attention
""")
_CPU_FP32 = _kinds("""
    avg_pool3d binary_cross_entropy grid_sampler grid_sampler_2d grid_sampler_2d_cpu_fallback grid_sampler_3d polar prod
    quantile nanquantile stft cdist trace view_as_complex cholesky cholesky_inverse
    cholesky_solve inverse lu_solve orgqr ormqr pinverse
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

# Composite ops (CompositeImplicitAutograd) with no autocast kernel of their own reach autocast as the GEMMs they
# decompose into (bmm, mm), so as one captured op they run in lower precision: measured under CPU autocast. CUDA
# lists einsum, chain_matmul and linalg_multi_dot itself, and puts tensordot on its promote list (the widest input
# dtype), so tensordot is lower precision on CPU only.
_COMPOSITE_GEMMS = _kinds("einsum inner chain_matmul linalg_multi_dot matrix_power linalg_matrix_power")
_CPU_COMPOSITE_GEMMS = _kinds("tensordot")

# compfx's own additions, on every device. F.multi_head_attention_forward stays
# one call in both tracers' graphs (dynamo keeps it whole too). Inside it the
# projections and attention GEMMs autocast to low precision (what CPU autocast
# also does for the fused _native_multi_head_attention, whose kind is the same),
# so the op as a whole counts as lower-precision.
_COMPFX_LOWER = _kinds("multi_head_attention")

#: Kinds on a device's list only where this torch registers the autocast kernel: (device type, kind) ->
#: (the op, its dispatch key, its category there). Older torch runs them in whatever dtype reaches them.
REGISTERED_SINCE: Mapping[tuple[str, str], tuple[str, str, Category]] = MappingProxyType({
    # FP32 under CUDA (and XPU) autocast from torch 2.12; torch 2.11 registers no autocast kernel for it.
    ("cuda", "rms_norm"): ("aten::rms_norm", "AutocastCUDA", Category.BLACKLIST),
    ("xpu", "rms_norm"): ("aten::rms_norm", "AutocastXPU", Category.BLACKLIST),
})


def _has_autocast_kernel(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
    except RuntimeError:  # an op this torch does not have
        return False


def _registered(device_type: str, category: Category) -> frozenset[str]:
    return frozenset(kind for (device, kind), (op, key, listed) in REGISTERED_SINCE.items()
                     if device == device_type and listed is category and _has_autocast_kernel(op, key))


#: device type -> (whitelist kinds, blacklist kinds)
AUTOCAST_POLICY: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cuda": (_CUDA_LOWER | _COMPOSITE_GEMMS | _COMPFX_LOWER, _CUDA_FP32 | _registered("cuda", Category.BLACKLIST)),
    "xpu": (_CUDA_LOWER | _COMPOSITE_GEMMS | _COMPFX_LOWER,  # CUDA's macros
            _CUDA_FP32 | _registered("xpu", Category.BLACKLIST)),
    "cpu": (_CPU_LOWER | _COMPOSITE_GEMMS | _CPU_COMPOSITE_GEMMS | _COMPFX_LOWER, _CPU_FP32),
}

#: Where the tables knowingly differ from this torch's autocast registrations, or cannot be checked against them:
#: (device type, aten op) -> why. ``tests/test_oplists.py`` accepts exactly these differences.
AUTOCAST_EXCEPTIONS: Mapping[tuple[str, str], str] = MappingProxyType({
    ("cuda", "aten::binary_cross_entropy"):
        "banned, not cast: CUDA autocast raises for it and points to binary_cross_entropy_with_logits. compfx "
        "leaves it 'other' (it runs in the dtype that reaches it), so a plan never fails where autocast would.",
    ("cuda", "aten::_cudnn_rnn"):
        "registered only in cuDNN builds (aten/src/ATen/cudnn/AutocastRNN.cpp), lower precision; its kernel "
        "reflattens the weights before it casts, which the test's stand-in tensors cannot feed. Classified "
        "whitelist as cudnn_rnn, and so are lstm, gru, rnn_tanh and rnn_relu, which reach it.",
})


def classify(kind: str, device_type: str, overrides: Mapping[str, Category | str] | None = None) -> Category:
    """Category of ``kind`` on ``device_type``; ``overrides`` (kind -> category) win.

    >>> [str(classify(kind, "cuda")) for kind in ("linear", "softmax", "relu")]
    ['whitelist', 'blacklist', 'other']
    >>> classify("softmax", "cpu")  # CPU autocast keeps softmax in the input dtype
    <Category.OTHER: 'other'>
    >>> classify("relu", "cpu", overrides={"relu": "blacklist"})
    <Category.BLACKLIST: 'blacklist'>
    """
    if overrides and kind in overrides:
        return Category.parse(overrides[kind], f"overrides[{kind!r}] (the category of an op kind)")
    lower, fp32 = AUTOCAST_POLICY.get(device_type, AUTOCAST_POLICY["cuda"])
    if kind in lower:
        return Category.WHITELIST
    if kind in fp32:
        return Category.BLACKLIST
    return Category.OTHER
