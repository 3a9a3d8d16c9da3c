"""The combined (text + image) layout of a LLaVA batch for the MTP block: token ids and loss mask.

``LLaVAModel._preprocess_data`` (megatron-core 0.19.x ``models/multimodal/llava_model.py:482``)
puts each text token's embedding at slot ``cumsum(width) - 1`` of its sample, where a text token is
one slot wide and an image placeholder as wide as its image's embeddings (``tiles x img_seq_len``,
:586-595); it pads shorter samples at the end and cuts the row at the language model's maximum
length (:734-746). The functions here place token ids and the caller's loss mask by the same rule,
with scatters (no boolean indexing, no ``.tolist()``): nothing waits for the device.

The id at an image slot is `fill_id`'s; padding slots get it too (their mask is 0: never trained).
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    import torch


def fill_id(image_token_index: int, vocab_size: int) -> int:
    """The id of an image slot: the image token itself when it is a vocabulary id, else 0.

    What the drafter sees at serving time: vLLM 0.33.0 turns multimodal inputs off for NemotronHMTP
    (``v1/spec_decode/llm_base_proposer.py:1345-1352``), so the drafter embeds the prompt's ids, every
    image placeholder included; an out-of-vocabulary placeholder (LLaVA's default -200) is the 0
    that ``LLaVAModel.forward`` embeds for its own text embeddings (``llava_model.py:1224``).
    """
    return image_token_index if 0 <= image_token_index < vocab_size else 0


def text_slots(input_ids: "torch.Tensor", image_token_index: int, num_image_tiles: "torch.Tensor",
               tokens_per_tile: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """``(is_image, slot)``, both [batch, text_length]: which input tokens are image placeholders,
    and the combined slot of each token's last embedding (a text token's only one).

    ``num_image_tiles``: tiles per image, images in reading order (sample after sample), as
    ``_preprocess_data`` takes it; ``tokens_per_tile``: embeddings per tile (``img_seq_len``, or 1 on
    the packed dynamic-resolution path, whose ``num_image_tiles`` holds each image's token count).
    """
    import torch

    is_image = input_ids == image_token_index
    width = torch.ones_like(input_ids)
    if num_image_tiles.numel():
        # the k-th placeholder in reading order takes num_image_tiles[k] tiles
        ordinal = (is_image.flatten().long().cumsum(0) - 1).clamp(min=0).view_as(input_ids)
        tiles = num_image_tiles.to(device=input_ids.device, dtype=input_ids.dtype)[ordinal]
        width = torch.where(is_image, tiles * tokens_per_tile, width)
    return is_image, width.cumsum(-1) - 1


def place(values: "torch.Tensor", is_image: "torch.Tensor", slot: "torch.Tensor", length: int,
          fill: "int | float") -> "torch.Tensor":
    """[batch, length]: ``values`` ([batch, text_length]) of the text tokens at their slots, ``fill``
    at image and padding slots; tokens past ``length`` (truncated) are dropped."""
    import torch

    spare = length  # one column past the row takes image placeholders and truncated tokens
    where = torch.where(is_image | (slot >= length), spare, slot)
    row = torch.full((values.shape[0], length + 1), fill, dtype=values.dtype, device=values.device)
    row.scatter_(1, where, torch.where(is_image, torch.full_like(values, fill), values))
    return row[:, :length]


def pad_to_multiple(tensor: "torch.Tensor", multiple: int, value: "int | float") -> "torch.Tensor":
    """``tensor`` ([batch, length]) padded at the end with ``value`` to a multiple of ``multiple``."""
    import torch

    missing = -tensor.shape[1] % multiple
    if not missing:
        return tensor
    return torch.nn.functional.pad(tensor, (0, missing), value=value)
