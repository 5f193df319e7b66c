"""Where the answers come from: the in-process engine (`LLM`) or an OpenAI-compatible server
(`--url`, e.g. `rlt serve`), with the same sampling parameters either way.

A backend runs one setting's prompts and reports each finished answer as it arrives
(`on_done(position, completion)`), so the live view and the JSONL keep up with the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlt_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import httpx

    from rlt_engine.llm import LLM

OnDone = Callable[[int, "Completion"], None]


class BackendError(ValueError):
    """A server that cannot be used or a request that failed (one line for the user)."""


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    exit_depths: list[int] | None  # None: the server does not report them
    finish_reason: str | None


class Backend(Protocol):
    description: str  # what is evaluated: the model directory, or the server's URL and model

    def run(self, prompts: Sequence[str], params: SamplingParams, on_done: OnDone) -> None: ...

    def close(self) -> None: ...


class InProcessBackend:
    """All prompts of a setting go to the engine at once; it batches them."""

    def __init__(self, llm: LLM, chat: bool) -> None:
        self.llm, self.chat = llm, chat
        self.description = llm.info.model_dir
        self._primed = False

    def _encode(self, prompt: str) -> list[int]:
        from rlt_engine.models.tokenizer import render_chat

        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise BackendError(f"{self.description} has no tokenizer, which text prompts need")
        if self.chat:
            return render_chat(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer.encode(prompt))

    def _prime(self, prompts: list[list[int]]) -> None:
        """Prefill the prompts' common prefix (the few-shot examples) once, so that the prefix
        cache serves it to every prompt: requests admitted together cannot share blocks that
        none of them has written yet."""
        self._primed = True
        if len(prompts) < 2:
            return
        prefix = _common_prefix(prompts)
        if len(prefix) >= self.llm.info.block_size:
            self.llm.generate([prefix], SamplingParams(max_tokens=1))

    def run(self, prompts: Sequence[str], params: SamplingParams, on_done: OnDone) -> None:
        encoded = [self._encode(p) for p in prompts]
        if not encoded:
            return
        if not self._primed:
            self._prime(encoded)
        engine = self.llm.engine
        ids: list[str] = []
        try:
            for prompt in encoded:
                ids.append(engine.add_request(prompt, params))
            position = {rid: i for i, rid in enumerate(ids)}
            left = set(ids)
            while left:
                for out in engine.step():
                    if out.finished and out.request_id in left:
                        left.discard(out.request_id)
                        if out.finish_reason in ("abort", "error"):
                            reason = out.error or out.finish_reason
                            raise BackendError(f"a request failed: {reason}")
                        completion = Completion(
                            out.text, len(out.token_ids), list(out.exit_depths), out.finish_reason
                        )
                        on_done(position[out.request_id], completion)
        finally:  # an error or Ctrl-C: free what this setting still holds (no-op if finished)
            for rid in ids:
                engine.abort_request(rid)

    def close(self) -> None:
        pass


def _common_prefix(prompts: list[list[int]]) -> list[int]:
    first = prompts[0]
    length = len(first)
    for prompt in prompts[1:]:
        n = min(length, len(prompt))
        i = 0
        while i < n and prompt[i] == first[i]:
            i += 1
        length = i
    return first[:length]


class HTTPBackend:
    """Requests to an OpenAI-compatible server, `concurrency` at a time: /v1/completions, or
    /v1/chat/completions with `chat`. The loop controls go as rlt's request extensions
    (`max_loops`, `exit_threshold`); `exit_depths` come back per choice from `rlt serve`."""

    RETRIES = 20  # for 429 / 503 answers (server busy or still loading)

    def __init__(
        self,
        url: str,
        model: str | None,
        chat: bool,
        concurrency: int,
        api_key: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]
        self.chat, self.concurrency = chat, concurrency
        key = api_key or os.environ.get("RLT_API_KEY") or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client: httpx.Client = httpx.Client(headers=headers, timeout=timeout)
        self.model = model or self._served_model()
        self.description = f"{self.url} ({self.model})"

    def _served_model(self) -> str:
        body = self._request("GET", "/v1/models")
        models = body.get("data") if isinstance(body, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise BackendError(f"{self.url}/v1/models lists no model: pass --model NAME")
        return str(models[0]["id"])

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        for attempt in range(self.RETRIES + 1):
            try:
                response = self.client.request(method, self.url + path, json=body)
            except httpx.HTTPError as exc:
                message = f"{method} {self.url}{path}: {type(exc).__name__}: {exc}"
                raise BackendError(message) from None
            if response.status_code in (429, 503) and attempt < self.RETRIES:
                time.sleep(float(response.headers.get("Retry-After", "1") or 1))
                continue
            if response.status_code != 200:
                raise BackendError(
                    f"{method} {self.url}{path}: HTTP {response.status_code}: "
                    f"{_error_message(response)}"
                )
            try:
                return response.json()
            except ValueError:
                raise BackendError(f"{method} {self.url}{path}: the answer is not JSON") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _body(self, prompt: str, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "stop": list(params.stop),
        }
        if self.chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        extras = {
            "seed": params.seed,
            "max_loops": params.max_loops,
            "exit_threshold": params.exit_threshold,
        }
        body.update({k: v for k, v in extras.items() if v is not None})
        return path, body

    def _complete(self, prompt: str, params: SamplingParams) -> Completion:
        path, body = self._body(prompt, params)
        answer = self._request("POST", path, body)
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] if self.chat else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise BackendError(f"POST {self.url}{path}: the answer has no choices[0]") from None
        depths = choice.get("exit_depths")
        tokens = (answer.get("usage") or {}).get("completion_tokens")
        if tokens is None:
            tokens = len(choice.get("token_ids") or depths or [])
        return Completion(text or "", int(tokens), depths, choice.get("finish_reason"))

    def run(self, prompts: Sequence[str], params: SamplingParams, on_done: OnDone) -> None:
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="rlt-eval") as pool:
            pending: dict[Future[Completion], int] = {}
            queue = list(enumerate(prompts))[::-1]
            try:
                while queue or pending:
                    while queue and len(pending) < self.concurrency:
                        position, prompt = queue.pop()
                        pending[pool.submit(self._complete, prompt, params)] = position
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        on_done(pending.pop(future), future.result())
            finally:
                for future in pending:
                    future.cancel()

    def close(self) -> None:
        self.client.close()


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    except ValueError:
        message = None
    return " ".join(str(message or response.text or response.reason_phrase).split())[:300]
