"""Side-by-side benchmark of loragate against vLLM's CPU build on the same machine.

    python -m benchmarks.peers.setup_venv [--venv PATH]      # once: vLLM in its own venv
    python -m benchmarks.peers [--quick] [--repeats N] [--parts agreement,mixed,rag,lora,serving]
        [--omp-wait-policy passive] [--vllm-eager]

Every workload runs on both engines with the same model, the same token ids and the same
settings (fp32, 2 threads, max_num_seqs 32, max_num_batched_tokens 512, block 32, greedy,
ignore_eos), each engine in its own process, one after the other, alternating A B A B.
The offline workloads go through small runner scripts (``run_loragate.py`` with this
interpreter, ``run_vllm.py`` with the vLLM venv's) that take a JSON job and write a JSON
result, so every timing is taken inside the engine's own process; the serving workload goes
through both OpenAI servers (``loragate serve`` and ``vllm serve``).

On a host shared with other work, pass ``--omp-wait-policy passive``: with the OpenMP
default (spin) and more runnable threads than cores, loragate's 2 threads stall on each
other 10-20x. The policy moves the ratios (it costs loragate's many small eager ops more
than vLLM's compiled graph), so compare figures taken under the same policy. ``--quick``
runs vLLM eager (``--vllm-eager``) to skip its minute-long inductor compile per start.

This package imports nothing heavy at import time: ``run_vllm.py`` runs under vLLM's
interpreter, where loragate's dependencies may be missing.
"""
