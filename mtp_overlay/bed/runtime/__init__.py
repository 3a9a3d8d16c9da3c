"""The bed's runtime: ranks (launcher, preloaded interpreters), the one answer to "which device"
(``device``), the CPU stand-ins for what only CUDA provides, host streams, the sync counter, other releases."""
