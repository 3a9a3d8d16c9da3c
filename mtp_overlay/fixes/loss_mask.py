"""PLACEHOLDER for fix mtp-loss-mask (being written)."""

from ..fix import Fix, Provenance, needed


class _Placeholder(Fix):
    name = "mtp-loss-mask"
    distribution = "placeholder"
    provenance = Provenance("TBD")

    def probe(self, module):
        return needed()


FIX = _Placeholder()
