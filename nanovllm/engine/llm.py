import time
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.outputs import RequestOutput

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Offline batched generation, shaped like vLLM's `LLM`.

    >>> llm = LLM()  # the default model, SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, **config) -> None:
        self.engine = LLMEngine(model, **config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks now (garbage collection and the process's
        exit do it otherwise); a no-op for one device."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt] | list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, token-id lists, or chat message lists).

        Outputs come back in input order. Every prompt is checked before any work starts.
        """
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        engine = self.engine
        rendered = [self._render(p) for p in prompt_list]
        token_ids = [engine.tokenize_prompt(p, sp) for p, sp in zip(rendered, params)]
        order: list[str] = []
        try:
            for p, ids, sp in zip(rendered, token_ids, params):
                order.append(engine.add_request(p, sp, prompt_token_ids=ids))
            return self._run(order, use_tqdm)
        except BaseException:
            for request_id in order:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(list(messages), sampling_params, use_tqdm)

    def _render(self, prompt) -> Prompt:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.engine.render_chat(prompt)
        return prompt

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        last_t, last_prefill, last_decode = time.perf_counter(), 0, 0
        pending = set(order)
        while pending:
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
            now = time.perf_counter()
            if use_tqdm and now - last_t > 0.5:
                dt = now - last_t
                bar.set_postfix(
                    prefill=f"{(engine.num_prefill_tokens - last_prefill) / dt:.0f}tok/s",
                    decode=f"{(engine.num_decode_tokens - last_decode) / dt:.0f}tok/s",
                )
                last_t, last_prefill, last_decode = (
                    now,
                    engine.num_prefill_tokens,
                    engine.num_decode_tokens,
                )
        bar.close()
        return [results[r] for r in order]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise InvalidRequestError("no prompts given", "prompts")
        if all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt as token ids
        if isinstance(prompts[0], dict):
            return [list(prompts)]  # one conversation
        return list(prompts)
    raise InvalidRequestError(
        "prompts must be a string, token ids, messages, or a list of those, "
        f"not {type(prompts).__name__}",
        "prompts",
    )


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(
            f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt",
            "sampling_params",
        )
    return params
