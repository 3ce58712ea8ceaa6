"""The host tier and the step trace behind the server: an evicted prefix comes back from
host memory (counted in /metrics by tier), and `--trace` records every step the server ran."""

import random

import openai
import pytest

from nanovllm.core.trace import read_trace
from tests.server.harness import metric, scrape, start_server, stop_server


@pytest.fixture(scope="module")
def tier_server(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "serve.jsonl"
    srv = start_server(tmp_path_factory, "tiers", "--num-kv-blocks", "24", "--block-size", "16",
                       "--cpu-offload-gib", "0.05", "--max-model-len", "384",
                       "--trace", str(trace))
    yield srv, trace
    stop_server(srv)


def test_an_evicted_prefix_is_a_host_hit_in_metrics_and_trace(tier_server):
    srv, trace = tier_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    rng = random.Random(0)
    first, other = ([rng.randrange(100, 40000) for _ in range(200)] for _ in range(2))

    def complete(ids):
        return client.completions.create(model=model, prompt=ids, max_tokens=4,
                                         temperature=0).choices[0].text

    before = scrape(srv)
    answer = complete(first)
    complete(other)  # 13 blocks of 16: the first prompt's cached blocks leave the device
    assert complete(first) == answer
    after = scrape(srv)
    hit = lambda m: metric(m, "nanovllm:prefix_cache_hit_blocks", tier="host")
    assert hit(after) - hit(before) > 0
    assert metric(after, "nanovllm:kv_blocks_copied", kind="offloaded") > 0
    assert metric(after, "nanovllm:num_host_kv_blocks") > 0

    header, steps = read_trace(str(trace))
    assert header["num_host_blocks"] == metric(after, "nanovllm:num_host_kv_blocks")
    assert sum(s["blocks"]["hit_host"] for s in steps) == hit(after)
    assert len([f for s in steps for f in s["finished"]]) >= 3
