"""The vLLM side of :class:`mta.generation.vllm_engine.VLLMGenerator`: a process in the vLLM
environment (``MTA_VLLM_PYTHON``) that holds one ``vllm.LLM`` and answers requests.

This file imports nothing of mta and nothing outside the standard library but vLLM: it runs by
its path under another Python, whose packages (vLLM pins its own transformers) are not mta's.

The protocol: JSON lines. The first line on stdin is the engine's configuration
(``{"model", "dtype", "seed", "tensor_parallel_size", "max_model_len", "enforce_eager"}``, and
``extra``: more ``vllm.LLM`` arguments); the
worker answers ``{"ready": true, "vllm": VERSION, "startup_s": S}`` (or ``{"error": ...}``). Then
each request ``{"prompts": [[ids]], "seeds": [int], "params": {temperature, top_k, top_p,
max_tokens, min_tokens, stop_token_ids}}`` is answered by ``{"outputs": [{"token_ids": [...],
"finish_reason": "stop" | "length"}]}`` in request order, and an empty line (or the end of stdin)
ends the worker. The answers go to a private copy of the original stdout; vLLM's own logging and
anything it prints go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # whatever vLLM prints lands on stderr, never in the protocol
    sys.stdout = sys.stderr

    def answer(payload: dict) -> None:
        protocol.write(json.dumps(payload) + "\n")
        protocol.flush()

    line = sys.stdin.readline()
    if not line.strip():
        return 0
    config = json.loads(line)
    started = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=config["model"],
            dtype=config["dtype"],
            seed=config.get("seed", 0),
            tensor_parallel_size=config.get("tensor_parallel_size", 1),
            max_model_len=config.get("max_model_len"),
            enforce_eager=config.get("enforce_eager", False),
            skip_tokenizer_init=True,  # ids in, ids out: mta tokenises and decodes
            disable_log_stats=True,
            **config.get("extra", {}),
        )
    except Exception as error:  # reported to the client, which names the fix
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    answer({"ready": True, "vllm": vllm.__version__, "startup_s": time.perf_counter() - started})
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        params = request["params"]
        try:
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]],
                [
                    SamplingParams(
                        n=1,
                        temperature=params["temperature"],
                        top_k=params["top_k"] if params["top_k"] > 0 else -1,
                        top_p=params["top_p"],
                        max_tokens=params["max_tokens"],
                        min_tokens=params["min_tokens"],
                        stop_token_ids=params["stop_token_ids"],
                        seed=seed,
                        detokenize=False,
                    )
                    for seed in request["seeds"]
                ],
                use_tqdm=False,
            )
        except Exception as error:
            answer({"error": f"{type(error).__name__}: {error}"})
            return 1
        answer(
            {
                "outputs": [
                    {"token_ids": list(out.outputs[0].token_ids), "finish_reason": out.outputs[0].finish_reason}
                    for out in outputs
                ]
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
