"""The lm-eval tasks of benchmarks/clients/lm_eval_check.py are well-formed: their YAMLs name
data files that exist next to them and columns those files have, every multiple-choice
question has four distinct choices and a valid answer index, every generation question a
one-word answer. Reads files only: no server, no lm-eval (it lives in its own venv)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.clients.lm_eval_run import TASKS, TASKS_DIR, render_tasks


def task_config(task: str) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((TASKS_DIR / f"{task}.yaml").read_text())
    return config


def task_rows(task: str) -> list[dict[str, Any]]:
    """The rows of the task's test split, read from the data file its YAML names."""
    config = task_config(task)
    path = TASKS_DIR / config["dataset_kwargs"]["data_files"][config["test_split"]]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("task", TASKS)
def test_yaml_names_its_task_and_local_json_data(task: str) -> None:
    config = task_config(task)
    assert config["task"] == task
    assert config["dataset_path"] == "json"
    files = config["dataset_kwargs"]["data_files"]
    assert set(files) == {config["test_split"]}
    assert all(not Path(name).is_absolute() and (TASKS_DIR / name).is_file()
               for name in files.values())


@pytest.mark.parametrize("task", TASKS)
def test_yaml_fields_reference_existing_columns(task: str) -> None:
    config, rows = task_config(task), task_rows(task)
    columns = set(rows[0])
    assert all(set(row) == columns for row in rows)
    for field in ("doc_to_target", "doc_to_choice"):
        if field in config:
            assert config[field] in columns, (field, config[field])
    assert "{{question}}" in config["doc_to_text"] and "question" in columns


def test_multiple_choice_questions() -> None:
    config, rows = task_config("loragate_mc"), task_rows("loragate_mc")
    assert config["output_type"] == "multiple_choice"
    assert [m["metric"] for m in config["metric_list"]] == ["acc", "acc_norm"]
    assert len(rows) >= 20
    for row in rows:
        assert len(row["choices"]) == len(set(row["choices"])) == 4, row
        assert isinstance(row["answer"], int) and 0 <= row["answer"] < 4, row
    assert len({row["question"] for row in rows}) == len(rows)
    # Answers spread over all four positions, so always picking one position scores low.
    assert {row["answer"] for row in rows} == {0, 1, 2, 3}


def test_generation_questions() -> None:
    config, rows = task_config("loragate_gen"), task_rows("loragate_gen")
    assert config["output_type"] == "generate_until"
    assert config["generation_kwargs"]["until"] == ["\n"]
    assert config["generation_kwargs"]["max_gen_toks"] == 16
    assert [m["metric"] for m in config["metric_list"]] == ["exact_match"]
    assert len(rows) >= 10
    assert all(isinstance(row["answer"], str) and len(row["answer"].split()) == 1
               for row in rows)


def test_rendered_tasks_name_absolute_data_files(tmp_path: Path) -> None:
    rendered = render_tasks(tmp_path)
    for task in TASKS:
        config = yaml.safe_load((rendered / f"{task}.yaml").read_text())
        for name in config["dataset_kwargs"]["data_files"].values():
            assert Path(name).is_absolute() and Path(name).is_file()
        assert {k: v for k, v in config.items() if k != "dataset_kwargs"} == {
            k: v for k, v in task_config(task).items() if k != "dataset_kwargs"}
