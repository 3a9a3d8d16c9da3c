"""Reading what the user gives verify: a Hugging Face config, or a Megatron-Bridge provider's path.

Errors name the flag (``--hf-config``, ``--provider``), which is also the API's argument name.
"""

from __future__ import annotations

import json
import os

from .vision import check_multimodal, is_multimodal


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """The dict of a Hugging Face ``config.json``: ``path`` is the file or a folder holding it (as
    ``AutoBridge.from_hf_config(AutoConfig.from_pretrained(folder))`` reads it); a multimodal config
    only in the Nemotron VL / Omni layout (`vision.check_multimodal`)."""
    name = os.fspath(path)
    file = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if os.path.isdir(name) and not os.path.isfile(file):
        found = "holds a config.json that is not a file" if os.path.exists(file) else "has no config.json"
        raise ValueError(f"--hf-config {name}: the folder {found}")
    if not os.path.isfile(file):
        raise ValueError(f"--hf-config {name}: no such file or folder")
    try:
        with open(file, encoding="utf-8") as handle:
            values = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"--hf-config {file}: not JSON ({error.msg}, line {error.lineno})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"--hf-config {file}: {not_utf8(error)} (a config.json is UTF-8 JSON)") from None
    except OSError as error:
        raise ValueError(f"--hf-config {file}: {error.strerror or error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--hf-config {file}: a config is a JSON object, got {type(values).__name__}")
    if not values.get("model_type"):
        raise ValueError(f"--hf-config {file}: no model_type (transformers reads the family from it)")
    if is_multimodal(values):
        check_multimodal(values, file)
    return values


def not_utf8(error: UnicodeDecodeError) -> str:
    """A file's UTF-8 decoding error in words: the first byte that is not UTF-8 and where."""
    return f"not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start})"


def check_provider_path(path: str) -> str:
    """``path`` as given, if it has the shape ``MODULE:NAME`` or ``FILE.py:NAME``; a ``FILE.py`` must
    compile (its syntax errors named with their line before any rank imports it; it is not run here)."""
    where, _, name = path.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"--provider must be MODULE:NAME or FILE.py:NAME (a provider, its class, or a function "
                         f"returning a provider or a recipe's ConfigContainer), got {path!r}")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(f"--provider {path}: no such file {where}")
        try:
            with open(where, "rb") as handle:
                compile(handle.read(), where, "exec", dont_inherit=True)
        except SyntaxError as error:  # a file that is not UTF-8 and declares no encoding is one too
            where_and_why = f"{where}:{error.lineno}: {type(error).__name__}: {error.msg}"
            raise ValueError(f"--provider {path}: {where_and_why}") from None
        except OSError as error:
            raise ValueError(f"--provider {path}: {error.strerror or error}") from None
    return path


def model_name(values: dict[str, object], fallback: str) -> str:
    """A short name of the config: its architecture (or model type)."""
    architectures = values.get("architectures")
    if isinstance(architectures, list) and architectures:
        return str(architectures[0])
    return str(values.get("model_type") or fallback)
