"""Offline batch generation: LLM(model_dir, **config).generate(prompts, params)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prompt_logprobs import PromptLogprob
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs a whole list of prompts through one engine with continuous batching and returns
    the finished outputs in prompt order."""

    def __init__(self, model: str, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._next_id = 0

    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter directory under ``name``."""
        self.engine.load_lora(name, path)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses without sampling_params: SamplingParams' defaults with the
        model's recommended sampling over them (EngineConfig.generation_config), as vLLM's
        LLM does."""
        return self.engine.sampling_defaults.sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priorities: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; ``lora`` names one adapter for all prompts or one per
        prompt (None: the base model). Adapters must be loaded first (load_lora())."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompt_list: list[Prompt] = [prompts]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()
                           ] * len(prompt_list)
        else:
            params_list = list(sampling_params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for "
                             f"{len(prompt_list)} prompts")
        prio = list(priorities) if priorities is not None else [0] * len(prompt_list)
        loras = ([lora] * len(prompt_list) if lora is None or isinstance(lora, str)
                 else list(lora))
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} adapters for {len(prompt_list)} prompts")

        # Validate everything before admitting anything: a bad prompt fails the call whole.
        requests = []
        for prompt, params, priority, adapter in zip(prompt_list, params_list, prio, loras,
                                                     strict=True):
            requests.append(self.engine.requests.make_request(
                f"llm-{self._next_id}", prompt, params, priority, lora=adapter))
            self._next_id += 1
        order = {r.request_id: i for i, r in enumerate(requests)}
        for request in requests:
            self.engine.add(request)

        results: list[RequestOutput | None] = [None] * len(requests)
        scored: dict[str, list[PromptLogprob | None]] = {}
        with tqdm(total=len(requests), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.prompt_logprobs is not None:  # reported once, maybe before the end
                        scored[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        out.prompt_logprobs = scored.get(out.request_id)
                        results[order[out.request_id]] = out
                        bar.update(1)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]
