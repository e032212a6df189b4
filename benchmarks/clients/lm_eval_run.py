"""One lm-evaluation-harness run against a server, driven through lm-eval's own CLI.

The CLI runs in the lm-eval venv (benchmarks/clients/setup_lm_eval.py) as a user would run
it: ``--model local-completions`` with token-id prompts (``tokenized_requests=True``), our
two local tasks from an ``--include_path``, and ``--log_samples`` so that every request's
arguments and the server's answers come back for checking.

Two things are prepared for it here. The task YAMLs name their data files relative to their
own directory, and lm-eval passes ``dataset_kwargs`` to ``datasets.load_dataset`` untouched,
which resolves them against the working directory; so they are rendered with absolute paths
into a fresh include directory, and the run works from any cwd. And lm-eval's transformers
(4.x, see setup_lm_eval.py) cannot load the tokenizer_config.json that loragate's
transformers (5.x) writes (its class ``TokenizersBackend`` is new in 5), so it is given a
tokenizer directory of its own: the same tokenizer.json (which alone defines the ids) under a
``PreTrainedTokenizerFast`` config with the same special tokens.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ("loragate_mc", "loragate_gen")
ENCODE_SCRIPT = Path(__file__).resolve().parent / "lm_eval_encode.py"


@dataclass(frozen=True)
class LmEvalRun:
    """What one lm-eval invocation left behind."""

    batch_size: int
    returncode: int
    wall_s: float
    output_dir: Path
    log_path: Path

    def results(self) -> dict[str, object]:
        """The run's results_*.json (lm-eval nests it under a per-model directory)."""
        found = sorted(self.output_dir.rglob("results_*.json"))
        if not found:
            raise FileNotFoundError(f"lm-eval wrote no results_*.json under {self.output_dir}")
        loaded: dict[str, object] = json.loads(found[-1].read_text())
        return loaded

    def samples(self, task: str) -> list[dict[str, object]]:
        """The logged samples of ``task``, one dict per document."""
        found = sorted(self.output_dir.rglob(f"samples_{task}_*.jsonl"))
        if not found:
            raise FileNotFoundError(f"lm-eval logged no samples of {task} under "
                                    f"{self.output_dir}")
        return [json.loads(line) for line in found[-1].read_text().splitlines() if line]


def render_tasks(into: Path) -> Path:
    """The task YAMLs, their data_files made absolute, written into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for task in TASKS:
        config = yaml.safe_load((TASKS_DIR / f"{task}.yaml").read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {
            split: str((TASKS_DIR / name).resolve()) for split, name in files.items()}
        (into / f"{task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return into


def tokenizer_dir(model_dir: Path, into: Path) -> Path:
    """A tokenizer-only directory that transformers 4.x loads (see the module docstring)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "chat_template.jinja"):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, into / name)
    source = json.loads((model_dir / "tokenizer_config.json").read_text())
    config = {key: value for key, value in source.items()
              if key.endswith("_token") or key == "model_max_length"}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (into / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return into


def model_args(completions_url: str, model_name: str, tokenizer: Path,
               num_concurrent: int = 1) -> str:
    """local-completions' --model_args: token-id prompts, ``num_concurrent`` requests in
    flight, one try (a refused request must fail the run, not be retried into a pass)."""
    return ",".join([f"base_url={completions_url}", f"model={model_name}",
                     f"tokenizer={tokenizer}", "tokenized_requests=True",
                     f"num_concurrent={num_concurrent}",
                     "max_retries=1", "tokenizer_backend=huggingface"])


def run_lm_eval(venv: Path, args: str, include_dir: Path, output_dir: Path, batch_size: int,
                limit: int | None, env: dict[str, str]) -> LmEvalRun:
    """lm-eval's CLI on our tasks; its output goes to ``output_dir``/lm_eval.log."""
    output_dir.mkdir(parents=True, exist_ok=True)
    command = [str(venv / "bin" / "python"), "-m", "lm_eval", "--model", "local-completions",
               "--model_args", args, "--tasks", ",".join(TASKS),
               "--include_path", str(include_dir), "--log_samples",
               "--output_path", str(output_dir), "--batch_size", str(batch_size)]
    if limit is not None:
        command += ["--limit", str(limit)]
    log_path = output_dir / "lm_eval.log"
    print("+ " + " ".join(command), flush=True)
    start = time.monotonic()
    with log_path.open("wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                              check=False)
    return LmEvalRun(batch_size, done.returncode, time.monotonic() - start, output_dir,
                     log_path)


def encode_requests(venv: Path, args: str, pairs: list[tuple[str, str]],
                    prompts: list[tuple[str, int]], env: dict[str, str]
                    ) -> tuple[list[dict[str, object]], list[list[int]]]:
    """lm-eval's token ids for each (context, continuation) pair and each (generation
    prompt, max_gen_toks), computed by lm-eval itself (benchmarks/clients/lm_eval_encode.py)."""
    request = json.dumps({"loglikelihood": pairs, "generate": prompts})
    done = subprocess.run([str(venv / "bin" / "python"), str(ENCODE_SCRIPT), args],
                          input=request, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval_encode.py failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    encoded = json.loads(done.stdout)
    return encoded["loglikelihood"], encoded["generate"]
