"""xshard's Hydra plugin package (discovered by Hydra's plugin scan; imports no JAX)."""
