import torch

import compfx


def test_capture_keys_linear_relu():
    gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
    assert [str(n.meta["compfx_key"]) for n in compfx.op_nodes(gm)] == ["0:linear#0", "1:relu#0"]
