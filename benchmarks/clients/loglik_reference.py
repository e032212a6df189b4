"""transformers' answers to lm-eval's requests: the reference the served results are held to.

A log-likelihood request is ``tokens`` (context + continuation ids) and ``ctxlen``; its value
is the sum of log p(tokens[i] | tokens[:i]) over the continuation, i in [ctxlen, len), and it
is greedy when every continuation token is the argmax at its position — what lm-eval's
``local-completions`` reads from the server's echoed prompt log-probs
(``token_logprobs[ctxlen:-1]``, the last entry being the one generated token). A generation
request is greedy decoding of ``max_gen_toks`` tokens, cut at the first stop string.

The model is ``AutoModelForCausalLM`` in float32, one unpadded sequence per forward pass,
so no padding or batching choice of the reference can move its numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from benchmarks.clients.lm_eval_compare import Loglik, LoglikRequest


class Reference:
    """A float32 transformers model and its tokenizer, loaded once from a local directory."""

    def __init__(self, model_dir: Path) -> None:
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    @torch.inference_mode()
    def loglikelihood(self, request: LoglikRequest) -> Loglik:
        tokens, ctxlen = request.tokens, request.ctxlen
        if not 0 < ctxlen < len(tokens):
            raise ValueError(f"ctxlen {ctxlen} must lie in (0, {len(tokens)})")
        ids = torch.tensor([tokens])  # [1, T]
        logits = self.model(ids).logits[0].float()  # [T, V]: position i predicts token i+1
        logprobs = torch.log_softmax(logits[ctxlen - 1:-1], dim=-1)  # [T - ctxlen, V]
        targets = ids[0, ctxlen:]  # [T - ctxlen]
        picked = logprobs.gather(1, targets[:, None])[:, 0]  # [T - ctxlen]
        greedy = bool((logprobs.argmax(dim=-1) == targets).all())
        return Loglik(float(picked.double().sum()), greedy)

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, stop: list[str]) -> str:
        """Greedy text after ``prompt``, cut before the earliest stop string; decoding also
        ends at the tokenizer's end-of-sequence token, as a server does."""
        eos = self.tokenizer.eos_token_id
        ids = list(prompt)
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1]  # [V]
            token = int(logits.argmax())
            if token == eos:
                break
            ids.append(token)
            if any(s in self._text(ids[len(prompt):]) for s in stop):
                break
        text = self._text(ids[len(prompt):])
        cut = min((text.find(s) for s in stop if s in text), default=len(text))
        return text[:cut]

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))
