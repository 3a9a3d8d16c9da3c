"""hf-modules-cache: what it targets and where it comes from (data only)."""

from mtp_overlay.contract import Declaration, Provenance

DECLARATION = Declaration(
    "hf-modules-cache",
    summary="Ray workers import transformers' trust_remote_code classes (HF_MODULES_CACHE on their path).",
    symptom="a Ray actor whose arguments hold a `trust_remote_code` config/tokenizer (transformers) dies with "
    "`No module named 'transformers_modules'`",
    distribution="ray",
    targets={"ray": "ray"},  # ray.init
    provenance=Provenance(origin="NeMo-RL (Ray actors receiving trust_remote_code configs and tokenizers)"),
)
