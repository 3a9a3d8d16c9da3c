"""What the product and the scripts run on the bed: verify's engine (a child process of ``mtp-overlay
verify``), the demo, parity across layouts, the hot path's host reads, the GPU check, patch measurement."""
