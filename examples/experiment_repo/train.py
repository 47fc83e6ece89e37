"""Trains with xshard's trainer from this repo's own Hydra app.

    python train.py                                  # experiment=small
    python train.py optimizer.learning_rate=1e-3     # any override
    python train.py -m --config-name sweep           # the grid of conf/sweep.yaml

`trainers.run` keeps xshard's exit statuses (0 done, 2 bad config with one line, 3 non-finite,
75 preempted after saving) and returns `trainer.objective` to optimizing sweepers;
`trainers.main` is `hydra.main` with xshard's guards (copied config files, early signals).
"""

import trainers


@trainers.main(config_path="conf", config_name="train")
def main(cfg) -> float | None:
    """Trains the composed config; returns the objective (the final eval/loss)."""
    return trainers.run(cfg)


if __name__ == "__main__":
    main()
