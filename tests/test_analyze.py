"""analyze(): category, kind and Tensor Core eligibility of every zoo op, written out by hand,
for a CUDA target (capability 8.0, fp16) and for CPU (bf16); and a Hugging Face BERT."""

import pytest
import torch

from compfx.analysis import analyze, analyze_graph
from compfx.graph_capture import capture
from compfx.errors import BadInputError
from compfx.opkey import OpKey
from zoo import ZOO, make

W, B, O = "whitelist", "blacklist", "other"

# Per zoo model, in graph order: (op key "module:kind#index", CUDA category,
# CUDA Tensor-Core eligible, CPU category). On CPU nothing is TC eligible.
# Why each TC verdict: M/N/K (or conv channels) must all be multiples of 8.
EXPECTED = {
    "mlp": [
        ("fc1:linear#0", W, False, W),  # input rows M=4
        (":relu#0", O, False, O),
        ("fc2:linear#0", W, False, W),  # M=4, out_features=10
    ],
    "cnn": [
        ("conv1:conv2d#0", W, False, W),  # in_channels=3
        ("bn1:batch_norm#0", O, False, O),
        (":relu#0", O, False, O),
        ("pool:max_pool2d#0", O, False, O),
        ("conv2:conv2d#0", W, True, W),  # 8 -> 16 channels
        ("bn2:batch_norm#0", O, False, O),
        (":relu#1", O, False, O),
        ("pool:max_pool2d#1", O, False, O),
        ("head:linear#0", W, False, W),  # M=2, N=10
    ],
    "encoder_matmul": [
        ("ln1:layer_norm#0", B, False, O),
        ("qkv:linear#0", W, True, W),  # M=2*8, N=48, K=16
        (":matmul#0", W, True, W),  # q @ k^T: 8x8 @ 8x8 per head
        (":div#0", O, False, O),
        (":softmax#0", B, False, O),
        (":matmul#1", W, True, W),
        ("proj:linear#0", W, True, W),
        ("drop:dropout#0", O, False, O),
        (":add#0", O, False, O),
        ("ln2:layer_norm#0", B, False, O),
        ("ff1:linear#0", W, True, W),  # N=64
        (":gelu#0", O, False, O),
        ("ff2:linear#0", W, True, W),  # K=64
        ("drop:dropout#1", O, False, O),
        (":add#1", O, False, O),
    ],
    "encoder_sdpa": [
        ("ln1:layer_norm#0", B, False, O),
        ("qkv:linear#0", W, True, W),
        (":scaled_dot_product_attention#0", W, False, W),  # no TC rule for attention kernels
        ("proj:linear#0", W, True, W),
        ("drop:dropout#0", O, False, O),
        (":add#0", O, False, O),
        ("ln2:layer_norm#0", B, False, O),
        ("ff1:linear#0", W, True, W),
        (":gelu#0", O, False, O),
        ("ff2:linear#0", W, True, W),
        ("drop:dropout#1", O, False, O),
        (":add#1", O, False, O),
    ],
    "mha": [
        ("attn:multi_head_attention#0", W, False, W),  # one op in both tracers; no TC rule
        ("out:linear#0", W, False, W),  # out_features=4
    ],
    "embed_gru": [
        ("embed:embedding#0", O, False, O),
        ("gru:gru#0", W, False, W),  # cuDNN RNN autocasts; CPU autocast casts its GEMM cells
        ("head:linear#0", W, False, W),  # M=2*6=12, N=20
    ],
    "shape_branch": [
        (":adaptive_avg_pool2d#0", O, False, O),
        ("fc:linear#0", W, False, W),  # M=2
        (":sigmoid#0", O, False, O),
        ("head:linear#0", W, False, W),  # M=2, N=3
    ],
}


def test_every_zoo_model_has_an_expected_table():
    assert sorted(EXPECTED) == sorted(ZOO)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cuda_fp16_analysis_matches_hand_written_table(name):
    model, inputs = make(name)
    analysis = analyze(model, inputs, device="cuda", capability=(8, 0))
    assert analysis.low_dtype == torch.float16
    got = [(str(op.key), op.kind, op.category, op.tc_eligible) for op in analysis.ops]
    want = [(key, OpKey.parse(key).kind, cuda, tc) for key, cuda, tc, _ in EXPECTED[name]]
    assert got == want
    for op in analysis.ops:
        assert op.tc_eligible == (op.reason == "dims are multiples of 8"), op.reason


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cpu_bf16_analysis_matches_hand_written_table(name):
    model, inputs = make(name)
    analysis = analyze(model, inputs)  # the model's device: CPU, so bf16
    assert (analysis.device.type, analysis.low_dtype) == ("cpu", torch.bfloat16)
    got = [(str(op.key), op.category, op.tc_eligible) for op in analysis.ops]
    assert got == [(key, cpu, False) for key, _, _, cpu in EXPECTED[name]]
    for op in analysis.ops:
        if op.category == W:
            assert op.reason == "cpu has no tensor cores"


def test_tc_reason_names_the_offending_dim():
    model, inputs = make("mha")
    analysis = analyze(model, inputs, device="cuda", capability=(8, 0))
    assert analysis.op(OpKey("out", "linear", 0)).reason == "out_features=4 is not a multiple of 8"
    analysis = analyze(model, inputs, device="cuda", low_dtype=torch.bfloat16, capability=(7, 5))
    assert analysis.op(OpKey("out", "linear", 0)).reason == "compute capability 7.5 < 8.0 for torch.bfloat16"


def test_stage1_sets_and_fingerprint():
    model, inputs = make("encoder_matmul")
    cuda = analyze(model, inputs, device="cuda", capability=(8, 0))
    cpu = analyze(model, inputs, device="cpu")
    assert [str(op.key) for op in cuda.stage1_adjustable] == ["ln1:layer_norm#0", ":softmax#0", "ln2:layer_norm#0"]
    assert len(cuda.stage1_ops) == 9 and len(cpu.stage1_ops) == 6  # CPU: norms/softmax are "other"
    assert cuda.fingerprint == cpu.fingerprint  # same structure, whatever the device
    assert "15 ops on cuda" in cuda.summary()
    assert "qkv:linear#0" in cuda.table()


def test_overrides_and_bad_low_dtype():
    model, inputs = make("mlp")
    analysis = analyze(model, inputs, overrides={"relu": "blacklist"})
    assert analysis.op(OpKey("", "relu", 0)).category == B
    with pytest.raises(BadInputError, match="float16 or torch.bfloat16"):
        analyze(model, inputs, low_dtype=torch.float32)


def test_leaf_module_kind_is_classified():
    model, inputs = make("cnn")
    analysis = analyze(model, inputs, device="cuda", capability=(8, 0), leaf_modules=[torch.nn.Conv2d])
    first = analysis.ops[0]
    assert (str(first.key), first.category, first.tc_eligible) == ("conv1:conv2d#0", W, False)


# ---------------------------------------------------------------------------
# Hugging Face BERT built from a config (no download)


@pytest.fixture(scope="module")
def tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=32, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs, capture(model, inputs)


def test_hf_bert_is_captured_by_recording_and_matches_eager(tiny_bert):
    model, inputs, gm = tiny_bert
    assert gm.meta["compfx_capture_method"] == "record"
    out, ref = gm(**inputs), model(**inputs)
    torch.testing.assert_close(out["last_hidden_state"], ref.last_hidden_state)
    torch.testing.assert_close(out["pooler_output"], ref.pooler_output)
    assert not model.training


@pytest.mark.parametrize(
    "device, norm_and_softmax", [("cuda", B), ("cpu", O)]
)
def test_hf_bert_categories_per_device(tiny_bert, device, norm_and_softmax):
    _, _, gm = tiny_bert
    analysis = analyze_graph(gm, device=torch.device(device),
                             low_dtype=torch.float16 if device == "cuda" else torch.bfloat16,
                             capability=(8, 0) if device == "cuda" else None)
    by_kind = {}
    for op in analysis.ops:
        by_kind.setdefault(op.kind, set()).add(op.category)
    assert by_kind["linear"] == {W}
    assert by_kind["matmul"] == {W}
    assert by_kind["layer_norm"] == by_kind["softmax"] == {norm_and_softmax}
    assert by_kind["gelu"] == {O}
    linears = [op for op in analysis.ops if op.kind == "linear"]
    assert len(linears) == 2 * 6 + 1  # q, k, v, attention output, intermediate, output; pooler
    query = analysis.op(OpKey("encoder.layer.0.attention.self.query", "linear", 0))
    assert query.tc_eligible == (device == "cuda")  # 16 rows x 32 x 32
    assert query.input_shapes[0] == (2, 8, 32)
