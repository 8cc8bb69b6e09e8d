"""The autocast tables agree with what torch.autocast really does (CPU, bf16), plus overrides."""

import pytest
import torch
import torch.nn.functional as F

from compfx.errors import BadInputError
from compfx.oplists import classify

BF16 = torch.bfloat16


def _t(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


# kind -> op on tensors of the given dtype (targets are integer, so not cast)
CPU_SAMPLES = {
    # whitelist
    "linear": lambda d: F.linear(_t(4, 8).to(d), _t(6, 8).to(d)),
    "matmul": lambda d: torch.matmul(_t(4, 8).to(d), _t(8, 6).to(d)),
    "bmm": lambda d: torch.bmm(_t(2, 4, 8).to(d), _t(2, 8, 6).to(d)),
    "baddbmm": lambda d: torch.baddbmm(_t(2, 4, 6).to(d), _t(2, 4, 8).to(d), _t(2, 8, 6).to(d)),
    "conv2d": lambda d: F.conv2d(_t(1, 4, 6, 6).to(d), _t(8, 4, 3, 3).to(d)),
    "scaled_dot_product_attention": lambda d: F.scaled_dot_product_attention(*(_t(1, 2, 4, 8).to(d),) * 3),
    # blacklist
    "mse_loss": lambda d: F.mse_loss(_t(4, 8).to(d), _t(4, 8).to(d)),
    "cross_entropy_loss": lambda d: F.cross_entropy(_t(4, 5).to(d), torch.tensor([0, 1, 2, 3])),
    "nll_loss": lambda d: F.nll_loss(_t(4, 5).to(d), torch.tensor([0, 1, 2, 3])),
    "binary_cross_entropy_with_logits": lambda d: F.binary_cross_entropy_with_logits(_t(4, 8).to(d), _t(4, 8).sigmoid().to(d)),
    "avg_pool3d": lambda d: F.avg_pool3d(_t(1, 2, 4, 4, 4).to(d), 2),
    # other on CPU (some are blacklist on CUDA)
    "relu": lambda d: F.relu(_t(4, 8).to(d)),
    "gelu": lambda d: F.gelu(_t(4, 8).to(d)),
    "layer_norm": lambda d: F.layer_norm(_t(4, 8).to(d), (8,)),
    "softmax": lambda d: _t(4, 8).to(d).softmax(-1),
    "sum": lambda d: _t(4, 8).to(d).sum(),
    "batch_norm": lambda d: F.batch_norm(_t(2, 4, 3, 3).to(d), None, None, training=True),
    "max_pool2d": lambda d: F.max_pool2d(_t(1, 2, 4, 4).to(d), 2),
}


def _autocast_dtype(op, input_dtype):
    with torch.autocast("cpu", dtype=BF16):
        return op(input_dtype).dtype


@pytest.mark.parametrize("kind", sorted(CPU_SAMPLES))
def test_cpu_table_matches_autocast_behaviour(kind):
    op = CPU_SAMPLES[kind]
    category = classify(kind, "cpu")
    from_fp32, from_bf16 = _autocast_dtype(op, torch.float32), _autocast_dtype(op, BF16)
    expected = {
        "whitelist": (BF16, BF16),  # cast down whatever comes in
        "blacklist": (torch.float32, torch.float32),  # cast up whatever comes in
        "other": (torch.float32, BF16),  # follows its input
    }[category]
    assert (from_fp32, from_bf16) == expected, f"{kind} is {category} in the CPU table"


def test_cross_entropy_spellings_agree():
    # F.cross_entropy calls torch._C._nn.cross_entropy_loss; both names must classify the same
    for device in ("cpu", "cuda"):
        assert classify("cross_entropy", device) == classify("cross_entropy_loss", device) == "blacklist"


@pytest.mark.parametrize(
    "kind, cuda, cpu",
    [
        ("linear", "whitelist", "whitelist"),
        ("conv_transpose2d", "whitelist", "whitelist"),
        ("scaled_dot_product_attention", "whitelist", "whitelist"),
        ("softmax", "blacklist", "other"),  # fp32_set_opt_dtype on CUDA only
        ("log_softmax", "blacklist", "other"),
        ("sum", "blacklist", "other"),
        ("cumsum", "blacklist", "other"),
        ("layer_norm", "blacklist", "other"),
        ("exp", "blacklist", "other"),
        ("pow", "blacklist", "other"),
        ("mse_loss", "blacklist", "blacklist"),
        ("gru", "whitelist", "whitelist"),  # cuDNN RNN autocast; CPU autocast casts its GEMM cells
        ("lstm", "whitelist", "whitelist"),  # cuDNN / mkldnn_rnn_layer
        ("max_pool3d", "other", "blacklist"),
        ("relu", "other", "other"),
        ("dropout", "other", "other"),
        ("add", "other", "other"),
        ("batch_norm", "other", "other"),
    ],
)
def test_policy_per_device(kind, cuda, cpu):
    assert (classify(kind, "cuda"), classify(kind, "cpu")) == (cuda, cpu)


def test_overrides_win_and_are_validated():
    assert classify("relu", "cuda", overrides={"relu": "blacklist"}) == "blacklist"
    assert classify("linear", "cpu", overrides={"relu": "blacklist"}) == "whitelist"
    with pytest.raises(BadInputError, match="expected one of"):
        classify("relu", "cuda", overrides={"relu": "fp32"})
