"""The seed's scheduling walkthrough: a 16-token budget, three waiting prompts A (6 tokens),
B (7) and C (5), policy prefill_first. Step 0 prefills A and B (13 tokens); C's 5 tokens do
not fit in the 3 left, and under prefill_first only a step's first prompt may be chunked, so
C waits. C is prefilled alone on step 1 (a step is all prefill or all decode, and prefill
goes first), then A, B and C decode together until each has its 3 tokens.

Run: python examples/scheduling_walkthrough.py [--trace FILE]"""

from stub_runner import StubRunner, parse_args


def main() -> None:
    args = parse_args(__doc__)
    runner = StubRunner(policy="prefill_first", max_num_batched_tokens=16, block_size=4,
                        num_blocks=16, max_num_seqs=4, trace=args.trace)
    a, b, c = (runner.add(name, n, max_tokens=3) for name, n in (("A", 6), ("B", 7), ("C", 5)))
    print("prefill_first, max_num_batched_tokens=16, blocks of 4 tokens; "
          f"waiting {runner.queue(runner.scheduler.waiting)} with 6, 7 and 5 prompt tokens")

    rows = runner.step()
    first = "[" + ", ".join(r["req"] for r in rows) + "]"
    waits = runner.queue(runner.scheduler.waiting)
    assert first == "[A, B]" and waits == "[C]", (first, waits)
    print(f"  -> step 0 ran {first} ({sum(r['tokens'] for r in rows)} of 16 tokens); "
          f"C waits: {waits} (5 tokens > 3 left, and only a step's first prompt may be chunked)")

    rows = runner.step()
    assert [(r["req"], r["kind"], r["tokens"]) for r in rows] == [("C", "prefill", 5)]
    print("  -> step 1 prefills C alone: a waiting prompt goes before the decodes")
    runner.run()
    assert all(s.num_output_tokens == 3 for s in (a, b, c))
    print(f"done in {runner.num_steps} steps: A, B and C have 3 output tokens each")
    runner.close()


if __name__ == "__main__":
    main()
