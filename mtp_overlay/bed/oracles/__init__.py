"""References from first principles: what an MTP fix must produce, written without megatron-core.

Each says, the slow obvious way, what a layout is and which (position, target) pairs MTP may train in
it; the tests run the installed upstream code, with a fix off and on, and compare it to these.

* ``packed_reference``: the per-sequence reference. A packed (THD) row is several sequences on padded
  boundaries; rolled by one, a slot holds the next token of its own sequence, never the next sequence's
  first token, and 0 where no label exists (the last real token, the padding); under context parallelism
  every sequence is cut into ``2 * cp`` chunks, rank r holding chunks r and ``2 * cp - 1 - r``.
* ``llava_oracle``: the combined-layout reference. A LLaVA batch's text and image embeddings become one
  combined row (an image placeholder takes as many slots as the image has embeddings); MTP trains the
  pairs of that combined row whose target is a text token, never an image slot; ``shard`` cuts it as
  LLaVAModel does under CP / SP. A packed multimodal row is both at once: ``combine`` first, then the
  per-sequence rule on the combined row's boundaries.
* ``tp_layout``: how a tensor-parallel parameter's shards make up its full tensor, so gradients are
  compared across TP sizes on the full tensor.

``models.packed.expected_mtp`` applies the per-sequence rule to a built ``PackedRow``; the verify engine's
oracle (``mtp_overlay.verification.oracle``) states the same rules for a shrunk user config, in the product.
"""
