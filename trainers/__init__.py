"""The generic pjit trainer for xshard and its built-in tasks."""
