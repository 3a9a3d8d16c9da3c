"""Upstream's own steps on the bed's models: Megatron's training step, its MoE bookkeeping, Bridge's
``gpt_step``, vLLM's worker, drafter, serving and chat-template sessions."""
