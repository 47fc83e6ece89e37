"""Which jobs of a multirun train as one population (`trainers.app.population_groups`): those
whose composed configs differ only in inputs of the compiled programs."""

from __future__ import annotations

from trainers.app.population_groups import group_jobs


def test_inputs_group_structure_splits(compose_config):
    configs = [
        compose_config("optimizer=adamw", "optimizer.learning_rate=1e-3"),
        compose_config("optimizer=adamw", "optimizer.learning_rate=1e-2", "clip=0.5"),
        compose_config("optimizer=sgd", "optimizer.learning_rate=1e-2"),
        compose_config("optimizer=adamw", "optimizer.weight_decay=0.1", "clip=1.0"),
        compose_config("optimizer=adamw", "trainer.microbatches=2"),
        compose_config("optimizer=adamw", "seed=1"),
    ]
    groups = group_jobs(configs)
    # clip=null (no clip) and clip=0.5 are two structures; 0.5 and 1.0 two inputs.
    assert [g.jobs for g in groups] == [[0], [1, 3], [2], [4], [5]]
    assert groups[1].notes == ["job 1 starts a population: not with job 0 (clip: None vs 0.5)"]
    assert "trainer.microbatches: 1 vs 2" in groups[3].notes[0]
    assert "seed: 0 vs 1" in groups[4].notes[0]


def test_periodic_axis_joins_but_its_variants_train_alone(compose_config):
    # DiLoCo's outer learning rate is an input; fragments (their own sync programs) are not
    # built in a population: that job trains alone, one line naming the key.
    diloco = ("mesh=cpu2x4_slices", "reduction=diloco")
    configs = [
        compose_config(*diloco),
        compose_config(*diloco, "reduction.axes.slice.outer_optimizer.learning_rate=0.7"),
        compose_config(*diloco, "reduction.axes.slice.fragments=2"),
    ]
    groups = group_jobs(configs)
    assert [g.jobs for g in groups] == [[0, 1], [2]]
    assert groups[1].notes == [
        "job 2 trains alone: reduction.axes.slice.fragments=2: a periodic axis syncs in a "
        "population only with fragments=1"
    ]


def test_hydra_launcher_population_is_xshards_launcher():
    from hydra import compose, initialize_config_module

    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose(
            "xshard_train", overrides=["hydra/launcher=population"], return_hydra_config=True
        )
    assert cfg.hydra.launcher._target_ == (
        "hydra_plugins.xshard_population.xshard_population.PopulationLauncher"
    )
