"""The shipped SLURM launcher config composes onto submitit's (hydra-submitit-launcher)."""

from hydra import compose, initialize_config_module


def test_hydra_launcher_slurm_is_submitit_with_a_signal_before_the_time_limit():
    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose("xshard_train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.tasks_per_node == 1 and launcher.nodes == 1
    assert launcher.signal_delay_s == 300 < launcher.timeout_min * 60
    assert "SIGUSR2" in cfg.trainer.stop_signals  # what submitit asks SLURM to send
