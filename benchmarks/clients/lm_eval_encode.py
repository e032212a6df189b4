"""The token ids lm-eval sent for each logged request, recomputed by lm-eval's own code.

    <lm-eval venv>/bin/python benchmarks/clients/lm_eval_encode.py MODEL_ARGS < requests.json

Run by the lm-eval venv's python (it imports only lm_eval and the standard library, never
loragate), so the reference log-likelihoods are computed over exactly the ids lm-eval put in
its requests: the model is built from the same ``--model_args`` string as the CLI builds it
(which loads the tokenizer and contacts no server), a (context, continuation) pair is split
by ``TemplateLM.loglikelihood``'s rule (``_encode_pair``; the prefix token for an empty
context) and cut by ``batch_loglikelihood_requests`` as the request batcher does; a
generation prompt is encoded by ``tok_encode`` and left-truncated as ``generate_until`` does.

stdin: ``{"loglikelihood": [[context, continuation], ...], "generate": [[context,
max_gen_toks], ...]}``; stdout: ``{"loglikelihood": [{"tokens": [...], "ctxlen": n}, ...],
"generate": [[...], ...]}``, in the same order.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from lm_eval.api.registry import get_model


def encode_pairs(lm: Any, pairs: list[list[str]]) -> list[dict[str, Any]]:
    """Each pair's request ids and context length, as lm-eval's loglikelihood path makes them."""
    requests = []
    for context, continuation in pairs:
        if context == "":
            context_enc, continuation_enc = [lm.prefix_token_id], lm.tok_encode(continuation)
        else:
            context_enc, continuation_enc = lm._encode_pair(context, continuation)
        requests.append((None, context_enc, continuation_enc))
    inputs, ctxlens, _ = lm.batch_loglikelihood_requests([requests])
    return [{"tokens": list(tokens), "ctxlen": ctxlen}
            for tokens, ctxlen in zip(inputs, ctxlens, strict=True)]


def encode_prompts(lm: Any, prompts: list[list[Any]]) -> list[list[int]]:
    """Each generation prompt's ids, left-truncated to leave room for max_gen_toks."""
    if not prompts:
        return []
    encoded = lm.tok_encode([context for context, _ in prompts],
                            add_special_tokens=lm.add_bos_token)
    return [list(ids[-(lm.max_length - int(max_gen_toks)):])
            for ids, (_, max_gen_toks) in zip(encoded, prompts, strict=True)]


def main() -> None:
    model_args = sys.argv[1]
    requests = json.load(sys.stdin)
    lm = get_model("local-completions").create_from_arg_string(model_args, {})
    json.dump({"loglikelihood": encode_pairs(lm, requests["loglikelihood"]),
               "generate": encode_prompts(lm, requests["generate"])}, sys.stdout)


if __name__ == "__main__":
    main()
