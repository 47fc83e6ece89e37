"""An example experiment repo on xshard: model, data, task and hook (see README.md)."""
