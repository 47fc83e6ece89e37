"""Every-step per-axis rules from the CLI: ``reduction=slice_int8`` (int8 with error feedback
over the DCN axis of mesh=cpu2x4_slices) and ``reduction=adasum`` (over ``data`` of mesh=cpu8)
train end to end, and their ``comm/<axis>/*`` tags are read back from TensorBoard."""

from __future__ import annotations

import math

import pytest

from tests.cli import refused, run_train, scalars

COMMON = (
    "task=mlp",
    "schedule=constant",
    "trainer.batch_size=16",
    "trainer.log_every=1",
    "trainer.steps=4",
    "checkpoint.enabled=false",
)


def _train(tmp_path, name, *overrides):
    run_train(*COMMON, *overrides, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
    return tmp_path / name / "tb"


SLICES = ("mesh=cpu2x4_slices", "reduction=slice_int8")


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    """One ``reduction=slice_int8`` run at ZeRO stage 0, its TensorBoard directory."""
    return _train(tmp_path_factory.mktemp("slice_int8"), "int8", *SLICES)


@pytest.mark.slow
def test_cli_slice_int8_sends_a_quarter_of_float32_and_logs_its_error(tmp_path, int8):
    full = _train(
        tmp_path,
        "float32",
        *SLICES,
        "reduction.axes.slice.comm_dtype=float32",
        "reduction.axes.slice.error_feedback=false",
    )
    sent_int8, sent_full = (
        scalars(int8, "comm/slice/bytes_per_step"),
        scalars(full, "comm/slice/bytes_per_step"),
    )
    assert sorted(sent_int8) == sorted(sent_full) == [1, 2, 3, 4]
    # int8 plus a float32 scale per block: a little over a quarter of float32's bytes.
    assert 3.5 < sent_full[4] / sent_int8[4] < 4.0, (sent_full, sent_int8)
    error = scalars(int8, "comm/slice/compression_error_norm")
    assert all(v > 0 for v in error.values()), error
    assert all(v == 0 for v in scalars(full, "comm/slice/compression_error_norm").values())
    for tb in (int8, full):
        assert all(math.isfinite(v) for v in scalars(tb, "train/loss").values())


@pytest.mark.slow
def test_cli_slice_int8_under_zero_2_trains_as_without(tmp_path, int8):
    plain = int8
    zero = _train(tmp_path, "zero2", *SLICES, "sharding.zero_stage=2")
    assert scalars(zero, "comm/slice/bytes_per_step") == scalars(plain, "comm/slice/bytes_per_step")
    want, got = scalars(plain, "train/loss"), scalars(zero, "train/loss")
    assert sorted(got) == [1, 2, 3, 4]
    assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (got, want)


@pytest.mark.slow
def test_cli_adasum_over_data_trains_and_logs_its_bytes(tmp_path):
    tb = _train(tmp_path, "adasum", "mesh=cpu8", "reduction=adasum")
    sent = scalars(tb, "comm/data/bytes_per_step")
    assert sorted(sent) == [1, 2, 3, 4] and sent[1] > 0
    assert all(v == 0 for v in scalars(tb, "comm/data/compression_error_norm").values())
    loss = scalars(tb, "train/loss")
    assert sorted(loss) == [1, 2, 3, 4] and all(math.isfinite(v) for v in loss.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["mesh=cpu8", "reduction=adasum", "reduction.axes.data.comm_dtype=int8"],
            ["reduction.axes.data.comm_dtype='int8'", "adasum"],
        ),
        (
            ["mesh=cpu8", "reduction=slice_int8"],
            ["reduction.axes.slice", "no axis 'slice'"],
        ),
    ],
    ids=["adasum-codec", "no-slice-axis"],
)
def test_cli_bad_every_step_rules_exit_2_naming_the_key(tmp_path, overrides, fragments):
    result = run_train(
        "task=mlp",
        *overrides,
        "trainer.steps=1",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
        check=False,
    )
    refused(result, *fragments)
