"""The strategies: one module each, on the shared base in `base`."""
