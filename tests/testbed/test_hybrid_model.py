"""A stock megatron-core HybridModel with MTP on CPU, built from local (non-TE) modules.

megatron-core 0.19 deprecates GPTModel in favour of HybridModel (Nemotron-H/Super are HybridModels).
The pattern "*-*-/*-" (attention, MLP, attention, MLP; one MTP depth of attention + MLP) holds the
parameters of the 2-layer tiny GPT in the same order, so from one seed both models must train
identically in every layout. HybridStack's hard-coded TENorm final norm runs as WrappedTorchNorm
(a CPU shim).
"""

import numpy as np
import pytest
from testbed_cases import layout_params

TOLERANCE = 1e-6


def test_hybrid_holds_the_tiny_gpts_parameters_in_order(tp1):
    gpt, hybrid = tp1[0]["bshd/gpt"]["params"], tp1[0]["bshd/hybrid"]["params"]
    assert len(gpt) == len(hybrid) == 47
    for (gpt_name, gpt_shape, gpt_value), (name, shape, value) in zip(gpt, hybrid):
        assert shape == gpt_shape, (name, gpt_name)
        assert np.array_equal(value, gpt_value), (name, gpt_name)
    names = [name for name, _, _ in hybrid]
    assert "decoder.final_norm.weight" in names  # HybridStack's own final norm (TENorm upstream)
    assert "mtp.layers.0.mtp_model_layer.layers.1.mlp.linear_fc1.weight" in names  # MTP depth = HybridStack "*-"


@pytest.mark.slow  # the zoo's and the parity table's HybridModel rows train these layouts through Megatron's step
@pytest.mark.parametrize("layout", layout_params("tp1", "cp2", "tp2_sp", "tp2_cp2_sp"))
def test_hybrid_trains_exactly_like_the_tiny_gpt(request, tp1, layout):
    """Same losses, MTP token counts and gradients as the GPT in the same layout (tiny_gpt.train_step),
    and the same losses as at TP1 (under CP with mtp-cp-loss-scale on)."""
    ranks = request.getfixturevalue(layout)
    for rank in ranks:
        gpt, hybrid = rank["bshd/gpt"], rank["bshd/hybrid"]
        assert gpt["error"] is None and hybrid["error"] is None
        assert hybrid["step"].lm_loss == pytest.approx(gpt["step"].lm_loss, abs=TOLERANCE)
        assert hybrid["step"].mtp_losses == pytest.approx(gpt["step"].mtp_losses, abs=TOLERANCE)
        assert hybrid["step"].mtp_tokens == gpt["step"].mtp_tokens
        assert hybrid["step"].zero_grad_params == ()
        assert max(np.abs(a - b).max() for a, b in zip(hybrid["grads"], gpt["grads"])) <= TOLERANCE
    reference = tp1[0]["bshd/hybrid"]["step"]
    assert ranks[0]["bshd/hybrid"]["step"].lm_loss == pytest.approx(reference.lm_loss, rel=1e-5)
    assert ranks[0]["bshd/hybrid"]["step"].mtp_losses == pytest.approx(reference.mtp_losses, rel=1e-5)
