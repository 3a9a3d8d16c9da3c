"""PLACEHOLDER for fix device-normalized-broadcast (being written)."""

from ..fix import Fix, Provenance, needed


class _Placeholder(Fix):
    name = "device-normalized-broadcast"
    distribution = "placeholder"
    provenance = Provenance("TBD")

    def probe(self, module):
        return needed()


FIX = _Placeholder()
