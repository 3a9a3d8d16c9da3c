"""mtp-sp-scatter on stock megatron-core: under TP2+SP a non-scattering embedding leaves the MTP
decoder input unscattered while the hidden states it is concatenated with are scattered."""

from ..runtime.launcher import run_ranks_checked


def reproduce():
    decoder, hidden = run_ranks_checked(stock_mtp_input_lengths, 2, tp=2, fixes=[])[0]
    return decoder != hidden, (
        f"TP2+SP, embedding not scattering: stock MTP decoder input holds {decoder} tokens per rank, "
        f"the hidden states {hidden}"
    )


def stock_mtp_input_lengths():
    """Rank worker: per-rank sequence length of the MTP decoder input that stock `_get_embeddings`
    returns for a non-scattering embedding under TP2+SP, and of the hidden states it meets."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    from mtp_overlay.fixes.mtp_sp_scatter import signature_variant, stock_get_embeddings

    from ..models.tiny_gpt import build_tiny_gpt, make_batch

    model = build_tiny_gpt(sequence_parallel=True, scatter_embedding_sequence_parallel=False)
    batch = make_batch()
    (batch_size, seq), tp = batch["input_ids"].shape, model.config.tensor_model_parallel_size
    hidden = torch.zeros(seq // tp, batch_size, model.config.hidden_size)
    method = stock_get_embeddings(MultiTokenPredictionLayer)
    _, index = signature_variant(method)
    result = method(model.mtp.layers[0], input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                    embedding=model.embedding, hidden_states=hidden)
    return result[index].shape[0], hidden.shape[0]
