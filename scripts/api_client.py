"""The benchmarks' OpenAI-API client: one streamed `/v1/completions` request timed as a client sees
it (no MLX here: scripts/bench_fleet.py never imports it into its own process)."""

from __future__ import annotations

import json
import time


def api_decode(http_base: str, prompt: str, tokens: int) -> tuple[float, list[float]]:
    """One streamed /v1/completions request of `tokens` tokens.

    Returns:
        (decode tokens/s = (completion tokens − 1) / (last text chunk − first text chunk), 0.0 when
        fewer than two tokens came; the perf_counter time of each text chunk, seconds).
    Raises:
        httpx.HTTPStatusError: the API answered with an error status.
    """
    import httpx
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    times, n = [], 0
    with httpx.stream("POST", f"{http_base}/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return ((n - 1) / (times[-1] - times[0]) if n > 1 and len(times) > 1 else 0.0), times
