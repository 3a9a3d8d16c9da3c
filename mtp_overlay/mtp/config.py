"""Apply the user's MTP keys to a TransformerConfig, refusing fields the installed core lacks.

NeMo-RL setattr's the keys blindly: on an older megatron-core a missing field becomes a plain
attribute nobody reads, and MTP silently runs with the defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..contract import distribution_version

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: megatron loads inside the functions
    from typing import TypeVar

    from megatron.core.transformer import TransformerConfig

    Config = TypeVar("Config", bound=TransformerConfig)

# megatron-core MTP feature -> first release carrying it: the one place these thresholds live
FIRST_RELEASE: dict[str, str] = {
    "mtp_num_layers": "0.12",
    "mtp_loss_scaling_factor": "0.12",
    "mtp_use_repeated_layer": "0.17",
    "mtp_detach_heads": "0.19",
    "mtp_grad_scale_func": "0.19.0",
    "mtp_labels_from_input_ids": "0.19.0",  # Megatron-LM PR #3457: labels=None rolls input_ids
}
# the TransformerConfig keys `apply_mtp_config` sets
MTP_CONFIG_KEYS: dict[str, str] = {key: FIRST_RELEASE[key] for key in ("mtp_num_layers", "mtp_loss_scaling_factor", "mtp_use_repeated_layer", "mtp_detach_heads")}


def apply_mtp_config(config: Config, mtp_config: Mapping[str, object]) -> Config:
    """Set each key of ``mtp_config`` present in it (of `MTP_CONFIG_KEYS`) on ``config``; return ``config``.

    ``config``: a TransformerConfig or a dataclass subclass of it (e.g. a Megatron-Bridge provider).
    ValueError for an unknown key, a value of the wrong kind (``mtp_num_layers``: None or an int
    >= 0; ``mtp_loss_scaling_factor``: a finite number >= 0; the others: bools), or a field the
    installed TransformerConfig lacks; then nothing is set. (A dataclass field takes anything:
    ``mtp_num_layers="two"`` or ``-1`` would be stored, and MTP would count as off.)
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config must be a TransformerConfig instance (a dataclass), got {type(config).__name__}")
    unknown = sorted(set(mtp_config) - set(MTP_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"mtp_config: unknown key(s) {unknown}; expected some of {list(MTP_CONFIG_KEYS)}")
    for key, value in mtp_config.items():
        _check_value(key, value)
    fields = {field.name for field in dataclasses.fields(config)}
    for key in mtp_config:  # all checked before any is set: a refused config is left untouched
        if key not in fields:
            raise ValueError(
                f"mtp_config[{key!r}]: {type(config).__name__} of the installed megatron-core {distribution_version('megatron-core')} "
                f"has no field {key!r} (added in {MTP_CONFIG_KEYS[key]}); refusing to set it silently"
            )
    for key, value in mtp_config.items():
        setattr(config, key, value)
    return config


def _check_value(key: str, value: object) -> None:
    """ValueError naming ``mtp_config[key]`` unless ``value`` is of the kind the key takes."""
    import math

    if key == "mtp_num_layers":
        expected = "None or an int >= 0 (the number of MTP depths)"
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    elif key == "mtp_loss_scaling_factor":
        expected = "a finite number >= 0"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    else:
        expected = "True or False"
        ok = isinstance(value, bool)
    if not ok:
        raise ValueError(f"mtp_config[{key!r}] must be {expected}, got {type(value).__name__} {value!r}")
