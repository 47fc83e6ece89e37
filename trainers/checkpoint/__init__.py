"""Checkpoints on disk: Orbax save and restore, ownership of the dir, space checks.

`save` saves (`CheckpointHook`), `io` knows the layout and the disk (complete steps, free
space, one-line I/O errors), `owner` keeps one run per checkpoint dir, `resume` finds and
restores the checkpoint to resume from (`unpacked`: a checkpoint of the optimizer state's
layout before its statistics were packed).

May import: `trainers.core`, `trainers.rundir`, `trainers.config`, `trainers.exits`,
`xshard`. Never the hooks, the cluster or the app, nor omegaconf or hydra (an import
contract): the run's config comes as plain values.
"""
