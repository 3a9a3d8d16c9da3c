"""PLACEHOLDER for fix hf-modules-cache (being written)."""

from ..fix import Fix, Provenance, needed


class _Placeholder(Fix):
    name = "hf-modules-cache"
    distribution = "placeholder"
    provenance = Provenance("TBD")

    def probe(self, module):
        return needed()


FIX = _Placeholder()
