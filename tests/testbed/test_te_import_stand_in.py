"""The scoped Transformer Engine import stand-in that lets Megatron-Bridge 0.6 import without TE.

Checked here on two throwaway importer modules (no Bridge needed); the test bed's Bridge tests check
it on Bridge's real ``peft/lora_layers.py`` and megatron-core's own ``HAVE_TE`` probes.
"""

import builtins
import importlib
import importlib.util
import sys

import pytest

from mtp_overlay.bed.runtime.bridge_stand_ins import transformer_engine_import_stand_in

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine is installed"
)

IMPORTER = """
import transformer_engine.pytorch as te
from transformer_engine.pytorch import Linear
from transformer_engine.pytorch.ops import Sequential
"""


@pytest.fixture
def importers(tmp_path, monkeypatch):
    (tmp_path / "te_stand_in_importer.py").write_text(IMPORTER)
    (tmp_path / "te_stand_in_bystander.py").write_text("import transformer_engine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "te_stand_in_importer", "te_stand_in_bystander"
    for name in ("te_stand_in_importer", "te_stand_in_bystander"):
        sys.modules.pop(name, None)


def test_only_the_named_importer_gets_the_stand_in_and_nothing_stays(importers):
    importer, bystander = importers
    original_import = builtins.__import__
    with transformer_engine_import_stand_in(importer=importer):
        module = importlib.import_module(importer)
        with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
            importlib.import_module(bystander)  # any other module still finds no TE
    te = module.te
    assert te.__name__ == "transformer_engine.pytorch" and module.Linear is te.Linear
    assert module.Sequential is te.ops.Sequential
    assert not isinstance(object(), (te.Linear, te.LayerNormLinear))  # no TE module exists
    with pytest.raises(AttributeError, match="stand-in"):
        te.fp8_autocast  # noqa: B018 - anything else says what it is
    assert builtins.__import__ is original_import
    assert not [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        importlib.reload(module)  # after the block, the importer itself finds no TE


def test_the_import_hook_is_removed_when_the_block_raises(importers):
    original_import = builtins.__import__
    with pytest.raises(RuntimeError, match="boom"):
        with transformer_engine_import_stand_in(importer=importers[0]):
            raise RuntimeError("boom")
    assert builtins.__import__ is original_import
