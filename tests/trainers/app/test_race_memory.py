"""`trainers.app.race_memory`: ``trainer.grad_impl=auto``'s choices remembered in the
compilation cache dir; what cannot be read or written costs a warning, never the run (the
CLI end to end: tests/trainers/app/test_grad_path_cli.py)."""

from __future__ import annotations

import json
import logging

from trainers.app.race_memory import RACED_AT, REMEMBERED, memory_file, recall, remember

PATHS = ("manual", "gspmd")
KEY = "a" * 64
RACE = {
    "chosen": "gspmd",
    "ms_per_step": {"manual": 2.5, "gspmd": 2.25},
    "refused": {},
    "seconds": 7.5,
    "steps_per_block": 8,
}


def test_a_remembered_race_is_recalled_with_when_it_ran_and_where(tmp_path):
    assert recall(tmp_path, KEY, PATHS) is None  # none yet
    remember(tmp_path, KEY, RACE)
    record = recall(tmp_path, KEY, PATHS)
    assert record is not None and {k: record[k] for k in RACE} == RACE
    assert record[RACED_AT].endswith("+00:00") and record[REMEMBERED] == str(
        memory_file(tmp_path, KEY)
    )
    assert [p.name for p in memory_file(tmp_path, KEY).parent.iterdir()] == [f"{KEY}.json"]
    assert recall(tmp_path, "b" * 64, PATHS) is None  # another key: other programs


def test_a_file_that_cannot_be_used_is_left_aside_with_a_warning(tmp_path, caplog):
    file = memory_file(tmp_path, KEY)
    file.parent.mkdir(parents=True)
    bad = {
        "truncated": '{"chosen": "gsp',
        "not a record": "[1, 2]",
        "another path": json.dumps({**RACE, "chosen": "fsdp"}),
        "a path this run cannot take": json.dumps({**RACE, "chosen": "gspmd"}),
        "a time that is not a number": json.dumps({**RACE, "ms_per_step": {"manual": "fast"}}),
    }
    for why, text in bad.items():
        file.write_text(text)
        caplog.clear()
        paths = ("manual",) if why == "a path this run cannot take" else PATHS
        with caplog.at_level(logging.WARNING, "trainers.train"):
            assert recall(tmp_path, KEY, paths) is None, why
        assert "trainer.grad_impl=auto: racing again: " + str(file) in caplog.text, why
    remember(tmp_path, KEY, RACE)  # the run's own race replaces it
    assert recall(tmp_path, KEY, PATHS)["chosen"] == "gspmd"


def test_a_memory_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache dir's grad_impl_race/ would go")
    with caplog.at_level(logging.WARNING, "trainers.train"):
        remember(blocked, KEY, RACE)
    assert "the race's choice is not remembered" in caplog.text
    assert blocked.read_text().startswith("a file")  # nothing else touched
