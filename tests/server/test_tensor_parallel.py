"""`nanovllm serve --tensor-parallel-size 2`: the engine process is rank 0 and starts rank 1;
the official `openai` client gets what one device generates, streamed or not, and the
server stops cleanly with no rank left behind."""

import openai

from nanovllm import LLM, SamplingParams
from tests.server.harness import start_server, stop_server


def test_tensor_parallel_server_serves_what_one_device_generates(tmp_path_factory, tiny_llama):
    flags = ["--model", str(tiny_llama), "--tensor-parallel-size", "2", "--num-kv-blocks", "128"]
    srv = start_server(tmp_path_factory, "tp", *flags)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        prompts = ["The quick brown fox", "Paged attention stores keys"]
        llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=128)
        expected = [o.text for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False)]
        got = client.completions.create(model=model, prompt=prompts, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
        stream = client.completions.create(model=model, prompt=prompts[0], max_tokens=12,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]
        assert any(b"nanovllm\x00worker" in _cmdline(pid) for pid in srv.descendants())
    finally:
        stop_server(srv)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
