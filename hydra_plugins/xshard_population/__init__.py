"""xshard's population launcher, ``hydra/launcher=population`` (imports no JAX)."""
