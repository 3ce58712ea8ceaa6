"""Chunked prefill of one 500,000-token prompt at 16,384 tokens a step, with blocks of 256
tokens: 1,954 blocks (the last one part full), 31 chunks (30 of 16,384, the last 8,480),
then a few decode steps. Under prefill_first the whole block table is allocated before the
first chunk. A stub runner stands in for the model, so it runs in seconds on a laptop.

Run: python examples/long_prompt.py [--trace FILE]"""

from stub_runner import StubRunner, parse_args

PROMPT, CHUNK, BLOCK, MAX_TOKENS = 500_000, 16_384, 256, 4


def main() -> None:
    args = parse_args(__doc__)
    runner = StubRunner(policy="prefill_first", block_size=BLOCK, num_blocks=2048,
                        max_num_seqs=4, max_num_batched_tokens=CHUNK, max_model_len=524_288,
                        trace=args.trace)
    seq = runner.add("L", PROMPT, max_tokens=MAX_TOKENS)
    print(f"prefill_first, max_num_batched_tokens={CHUNK:,}, 2,048 KV blocks of {BLOCK}; "
          f"one {PROMPT:,}-token prompt L, {MAX_TOKENS} output tokens")

    chunks = [runner.step()[0]["tokens"]]
    blocks = len(seq.block_table)
    assert blocks == -(-PROMPT // BLOCK) == 1954
    while seq.in_prefill:
        chunks.append(runner.step()[0]["tokens"])
    runner.run()
    assert len(chunks) == -(-PROMPT // CHUNK) == 31 and sum(chunks) == PROMPT
    assert chunks[:-1] == [CHUNK] * 30 and chunks[-1] == PROMPT - 30 * CHUNK == 8480
    assert seq.num_output_tokens == MAX_TOKENS
    print(f"{PROMPT:,}-token prompt: {blocks} blocks of {BLOCK} (allocated before the first "
          f"chunk), {len(chunks)} chunks of {CHUNK:,} tokens, the last {chunks[-1]:,}; then "
          f"{runner.num_steps - len(chunks)} decode steps: {runner.num_steps} steps in all")
    runner.close()


if __name__ == "__main__":
    main()
