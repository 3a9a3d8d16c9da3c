"""Reading what the user gives verify: a Hugging Face config, or a Megatron-Bridge provider's path.

Errors name the flag (``--hf-config``, ``--provider``), which is also the API's argument name.
"""

from __future__ import annotations

import json
import os

# configs of models with a vision tower or audio encoder: the test bed builds their language model's
# MTP path only once a fix for MTP on multimodal models (LLaVAModel's combined sequence) exists
MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_projector_type")


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """The dict of a Hugging Face ``config.json``: ``path`` is the file or a folder holding it (as
    ``AutoBridge.from_hf_config(AutoConfig.from_pretrained(folder))`` reads it)."""
    name = os.fspath(path)
    file = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if os.path.isdir(name) and not os.path.isfile(file):
        raise ValueError(f"--hf-config {name}: the folder has no config.json")
    if not os.path.isfile(file):
        raise ValueError(f"--hf-config {name}: no such file or folder")
    try:
        with open(file, encoding="utf-8") as handle:
            values = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"--hf-config {file}: not JSON ({error.msg}, line {error.lineno})") from None
    except OSError as error:
        raise ValueError(f"--hf-config {file}: {error.strerror or error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--hf-config {file}: a config is a JSON object, got {type(values).__name__}")
    if not values.get("model_type"):
        raise ValueError(f"--hf-config {file}: no model_type (transformers reads the family from it)")
    multimodal = [key for key in MULTIMODAL_KEYS if values.get(key)]
    if multimodal:
        raise ValueError(
            f"--hf-config {file}: a multimodal config ({', '.join(multimodal)}): verify builds the language model's "
            "MTP path only; its combined (text + image) sequence needs the multimodal MTP fix in the overlay, which "
            "verify takes in as soon as it is registered (the vision tower shrunk like the language model)"
        )
    return values


def check_provider_path(path: str) -> str:
    """``path`` as given, if it has the shape ``MODULE:NAME`` or ``FILE.py:NAME``."""
    where, _, name = path.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"--provider must be MODULE:NAME or FILE.py:NAME (a provider, its class, or a function "
                         f"returning a provider or a recipe's ConfigContainer), got {path!r}")
    if where.endswith(".py") and not os.path.isfile(where):
        raise ValueError(f"--provider {path}: no such file {where}")
    return path


def model_name(values: dict[str, object], fallback: str) -> str:
    """A short name of the config: its architecture (or model type)."""
    architectures = values.get("architectures")
    if isinstance(architectures, list) and architectures:
        return str(architectures[0])
    return str(values.get("model_type") or fallback)
