import time
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.engine.chat_output import ChatOutputParser, ChatTools
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
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        `tools`, `tool_choice`, `parallel_tool_calls`: OpenAI's tool calling; the tools are
        rendered by the chat template, "required" or a named function is forced by the grammar
        engine, "auto" is read in the model's own format (the engine's tool_call_parser).
        `chat_template_kwargs` reach the template (e.g. {"enable_thinking": False}). With tools
        or a reasoning parser, each completion's `text` is also read as its
        `reasoning_content`, `content` and `tool_calls` (engine/chat_output.py).
        """
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        engine = self.engine
        chat_tools = None
        if tools is not None or tool_choice is not None:
            chat_tools = ChatTools(tools, tool_choice, parallel_tool_calls,
                                   engine.tool_call_parser)
        params = _as_params_list(sampling_params, len(messages))
        kwargs = dict(chat_template_kwargs or {})
        if chat_tools is not None:
            params = [chat_tools.constrain(p) for p in params]
            kwargs["tools"] = chat_tools.template_tools
        prompts = [engine.render_chat(list(m), **kwargs) for m in messages]
        outputs = self.generate(prompts, params, use_tqdm)
        parser = ChatOutputParser(engine.config.reasoning_parser, chat_tools)
        if parser.reasoning is not None or parser.tools is not None:
            for out in outputs:
                for c in out.outputs:
                    reply = parser.parse(c.text)
                    c.reasoning_content, c.content = reply.reasoning, reply.content
                    c.tool_calls = reply.tool_calls
        return outputs

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
