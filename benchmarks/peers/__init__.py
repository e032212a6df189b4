"""Side-by-side benchmark of loragate against vLLM's CPU build on the same machine.

    python -m benchmarks.peers.setup_venv [--venv PATH]      # once: vLLM in its own venv
    python -m benchmarks.peers [--quick] [--repeats N] [--parts mixed,rag,lora,agreement,serving]

Every workload runs on both engines with the same model, the same token ids and the same
settings (fp32, 2 threads, max_num_seqs 32, max_num_batched_tokens 512, block 32, greedy,
ignore_eos), each engine in its own process, one after the other, alternating A B A B.
The offline workloads go through small runner scripts (``run_loragate.py`` with this
interpreter, ``run_vllm.py`` with the vLLM venv's) that take a JSON job and write a JSON
result, so every timing is taken inside the engine's own process; the serving workload goes
through both OpenAI servers (``loragate serve`` and ``vllm serve``).

This package imports nothing heavy at import time: ``run_vllm.py`` runs under vLLM's
interpreter, where loragate's dependencies may be missing.
"""
