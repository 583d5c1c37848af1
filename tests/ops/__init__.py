"""The array-work layer: dtypes, zero-copy buffer views, reduction kernels (synchronous, no IO)."""
