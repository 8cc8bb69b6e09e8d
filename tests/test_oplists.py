"""The autocast tables agree with what torch.autocast really does (CPU, bf16), with this torch's dispatcher
(every AutocastCPU / AutocastCUDA kernel that casts), plus overrides."""

import functools

import pytest
import torch
import torch.nn.functional as F

from compfx.errors import BadInputError
from compfx.opkey import normalize_kind
from compfx.oplists import AUTOCAST_EXCEPTIONS, REGISTERED_SINCE, classify

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
    # composites: no autocast kernel of their own, lower precision through the GEMMs they decompose into
    "einsum": lambda d: torch.einsum("bij,bjk->bik", _t(2, 4, 8).to(d), _t(2, 8, 6).to(d)),
    "tensordot": lambda d: torch.tensordot(_t(4, 8).to(d), _t(8, 6).to(d), dims=1),
    "inner": lambda d: torch.inner(_t(4, 8).to(d), _t(6, 8).to(d)),
    "linalg_multi_dot": lambda d: torch.linalg.multi_dot([_t(4, 8).to(d), _t(8, 6).to(d), _t(6, 2).to(d)]),
    "linalg_matrix_power": lambda d: torch.linalg.matrix_power(_t(4, 4).to(d), 3),
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


# ---------------------------------------------------------------------------
# the tables against this torch's dispatcher (runs on CPU; CUDA's kernels are read without CUDA)

AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
LOW = {"cpu": torch.bfloat16, "cuda": torch.float16}
EXPECTED = {"lower_precision_fp": "whitelist", "fp32": "blacklist"}


class _Stop(Exception):
    """Raised at the first op autocast's kernel hands on: what it cast is known by then."""


class _StandIn(torch.Tensor):
    """A data-free tensor that claims a device (CUDA too, on a CPU-only build) and records what is done to it.

    Its dispatch keys follow the claimed device, so a call reaches that device's
    autocast kernel. Casts come back as stand-ins of the new dtype; any other op
    the kernel hands on to is recorded with the dtype it was passed, then stops
    the call. Below autograd (see :func:`_policy`), composite ops arrive whole.
    """

    record: list = []

    @staticmethod
    def __new__(cls, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, (2, 2), dtype=dtype, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.dtype)]
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to):
            dtype = dtypes[0] if dtypes else args[0].dtype
            cls.record.append(("cast", dtype))
            return _StandIn(dtype, args[0].device)
        cls.record.append(("call", dtypes[0] if dtypes else None))
        raise _Stop


def _argument(kind, make):
    """A value of schema type ``kind`` (a torch._C.JitType) that autocast's kernels accept; tensors are stand-ins."""
    name = kind.kind()
    if name == "TensorType":
        return make()
    if name == "OptionalType":
        return None
    if name == "ListType":
        item = kind.getElementType()
        return [make(), make()] if item.kind() == "TensorType" else [_argument(item, make)]
    simple = {"IntType": 1, "SymIntType": 1, "FloatType": 1.0, "NumberType": 1, "BoolType": False,
              "StringType": "fro", "ScalarTypeType": torch.float32}
    return simple[name]


def _dimname_overload(op: torch._ops.OpOverload) -> bool:
    """A named-tensor overload (``softmax.Dimname``, ``sum.dim_DimnameList``): its ``dim`` is a name.

    Their schema types the name ``str``, like ``norm``'s ``p="fro"``; only the overload name tells them apart.
    torch 2.11 registers autocast kernels for eight of them, torch 2.13 none.
    """
    return "dimname" in op._overloadname.lower() or op._overloadname.startswith("names_")


#: A dimension name as ``torch.ops`` takes it (the ``dimname`` namespace): what a named tensor's ``"N"`` becomes.
_DIMNAME = "dimname::N"


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def _run(op, device, dtype) -> list:
    _StandIn.record = []
    args, kwargs = [], {}
    named = _dimname_overload(op)
    for argument in op._schema.arguments:
        value = _argument(argument.type, lambda: _StandIn(dtype, device))
        if named and argument.name in ("dim", "names"):  # a name, not norm's "fro"
            value = [_DIMNAME] if isinstance(value, list) else _DIMNAME
        (kwargs.__setitem__(argument.name, value) if argument.kwarg_only else args.append(value))
    try:
        with torch._C._AutoDispatchBelowADInplaceOrView():  # composite ops reach the stand-ins whole
            op(*args, **kwargs)
    except _Stop:
        pass
    except Exception as error:  # noqa: BLE001 - a kernel that refuses the stand-ins (or bans the op)
        _StandIn.record.append(("error", f"{type(error).__name__}: {str(error).splitlines()[0]}"))
    return _StandIn.record


def _policy(name: str, device: str) -> str:
    """What this torch's autocast kernel for op ``name`` on ``device`` does: its cast policy, as far as it shows.

    ``lower_precision_fp`` when FP32 inputs are cast to the low dtype; ``fp32``
    when low inputs are cast to FP32 or the op is handed ``dtype=float32``
    (``fp32_set_opt_dtype`` / ``fp32_append_dtype``); ``other`` otherwise
    (``promote``: same-dtype inputs pass as they are); ``error: ...`` when the
    kernel refused the stand-ins.
    """
    op, low = _overload(name), LOW[device]
    enabled, autocast_dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, low)
    try:
        from_fp32, from_low = _run(op, device, torch.float32), _run(op, device, low)
    finally:
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, autocast_dtype)
    if ("cast", low) in from_fp32:
        return "lower_precision_fp"
    if ("cast", torch.float32) in from_low or ("call", torch.float32) in from_low:
        return "fp32"
    errors = [detail for what, detail in from_fp32 + from_low if what == "error"]
    return f"error: {errors[0]}" if errors else "other"


@functools.lru_cache(maxsize=None)
def _registered(device: str) -> dict[str, str]:
    """aten op -> policy, for every aten op this torch registers an autocast kernel for on ``device``."""
    key = AUTOCAST_KEYS[device]
    names = sorted(name for name in torch._C._dispatch_get_all_op_names()
                   if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key))
    return {name: _policy(name, device) for name in names}


def _kind(name: str) -> str:
    return normalize_kind("call_function", _overload(name))


@pytest.mark.parametrize("name, device, policy", [
    ("aten::linear", "cpu", "lower_precision_fp"),
    ("aten::linear", "cuda", "lower_precision_fp"),
    ("aten::mse_loss", "cpu", "fp32"),
    ("aten::mse_loss", "cuda", "fp32"),
    ("aten::softmax.int", "cuda", "fp32"),  # fp32_set_opt_dtype: dtype=float32 is passed on
    ("aten::norm.Scalar", "cuda", "fp32"),  # fp32_append_dtype: redispatched to the dtype overload
    ("aten::addcmul", "cuda", "other"),  # promote
    ("aten::cat", "cpu", "other"),  # promote
])
def test_the_probe_reads_known_policies(name, device, policy):
    assert _registered(device)[name] == policy


@pytest.mark.parametrize("device", sorted(AUTOCAST_KEYS))
def test_every_op_autocast_casts_is_classified_so_or_listed_as_an_exception(device):
    policies = _registered(device)
    assert sum(p == "fp32" for p in policies.values()) > 20 and sum(
        p == "lower_precision_fp" for p in policies.values()) > 10, "the probe no longer reads autocast's kernels"
    wrong = []
    for name, policy in policies.items():
        if (device, name) in AUTOCAST_EXCEPTIONS:
            continue
        if policy.startswith("error"):
            wrong.append(f"{name}: the probe could not read its policy ({policy})")
        elif policy in EXPECTED and classify(_kind(name), device) != EXPECTED[policy]:
            wrong.append(f"{name} (kind {_kind(name)!r}) has the {policy} policy but is classified "
                         f"{str(classify(_kind(name), device))!r}")
    assert not wrong, (f"this torch ({torch.__version__}) registers {AUTOCAST_KEYS[device]} kernels that "
                       f"compfx.oplists misses: {wrong}. Add each kind to the {device} set in compfx/oplists.py, or "
                       "list the op in AUTOCAST_EXCEPTIONS with the reason.")


@pytest.mark.parametrize("device", sorted(AUTOCAST_KEYS))
def test_no_listed_kind_is_registered_with_another_policy(device):
    """The other direction, for kinds this torch registers at all (kinds it lacks are compfx's own, or older)."""
    wrong = [f"{name} (kind {_kind(name)!r}) is {str(classify(_kind(name), device))!r} but its policy is {policy}"
             for name, policy in _registered(device).items()
             if (device, name) not in AUTOCAST_EXCEPTIONS and classify(_kind(name), device) != "other"
             and EXPECTED.get(policy) != classify(_kind(name), device)]
    assert not wrong, wrong


def test_versioned_kinds_follow_this_torchs_registration_and_exceptions_say_why():
    for (device, kind), (op, key, category) in REGISTERED_SINCE.items():
        registered = torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
        assert classify(kind, device) == (category if registered else "other"), (device, kind, torch.__version__)
    for (device, name), reason in AUTOCAST_EXCEPTIONS.items():
        assert device in AUTOCAST_KEYS and name.startswith("aten::") and len(reason) > 40
