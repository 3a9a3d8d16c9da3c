"""Model folders as the installed transformers saves them (``save_pretrained``), for verify's tests: the
configs users have, not hand-written JSON (transformers 5 writes ``layers_block_type`` lists and
``{"__float__": "Infinity"}`` for inf), and an engine answering as a cured path would (`OracleEngine`)."""

import json
from pathlib import Path

from mtp_overlay.verification import data, oracle

CONFIGS = Path(__file__).parent / "configs"
# the NemotronH-like folder's values as NemotronHConfig arguments (M, E and * layers; MTP "*E" at 2 depths)
NEMOTRON_H = {key: value for key, value in json.loads((CONFIGS / "nemotron_h_like" / "config.json").read_text()).items()
              if key not in ("model_type", "torch_dtype")}


def nemotron_h(folder, **changes):
    """``folder`` holding ``NemotronHConfig(**NEMOTRON_H, **changes).save_pretrained(folder)``."""
    from transformers import NemotronHConfig

    NemotronHConfig(**{**NEMOTRON_H, **changes}).save_pretrained(folder)
    return Path(folder)


def nemotron_omni(folder, **llm_changes):
    """The Nemotron-Omni-like folder with the ``llm_config`` a NemotronHConfig writes (its remote-code
    config class nests the language model's ``to_dict``, JSON-encoded as transformers encodes it)."""
    from transformers import NemotronHConfig

    values = json.loads((CONFIGS / "nemotron_omni_like" / "config.json").read_text())
    values["llm_config"] = json.loads(NemotronHConfig(**{**NEMOTRON_H, **llm_changes}).to_json_string())
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "config.json").write_text(json.dumps(values))
    return Path(folder)


def saved(config, folder):
    """``folder`` holding ``config.save_pretrained(folder)``."""
    config.save_pretrained(folder)
    return Path(folder)


class OracleEngine:
    """An engine whose every step trains exactly the oracle's pairs with the reference's numbers (what a
    cured path gives), recording the plans and layouts it was asked to run: for what verify asks and names."""

    def __init__(self):
        self.layouts, self.plans = [], []

    def request(self, message):
        plan = message["plan"]
        self.plans.append(plan)
        sequences = tuple(data.Sequence(tuple(tokens), prompt) for tokens, prompt in zip(plan["sequences"],
                                                                                        plan["prompts"]))
        config = plan["model"]["config"]
        depths = config.get("llm_config", config)["num_nextn_predict_layers"]
        trained = [sorted(map(list, oracle.allowed(sequences, depth, plan["forward"]))) for depth in
                   range(1, depths + 1)]
        cases = []
        for layout, steps in message["jobs"]:
            self.layouts.append(layout)
            cases += [dict(case=name, layout=layout, fixes=fixes, error=None, trained=trained, lm_loss=4.8,
                           mtp_losses=[4.9] * depths, grad_relerr={"mtp": 0.0, "lm": 0.0},
                           max_delta={"mtp": 0.0, "lm": 0.0}) for name, fixes in steps]
        return dict(cases=cases)

    def close(self):
        pass
