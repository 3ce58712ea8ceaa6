"""Preempted sequences keep their order at the head of the waiting queue. Six 4-token prompts
A-F fill all six KV blocks of 4 tokens; G waits for a block. On the next decode step each
sequence needs a second block, so the scheduler preempts from the tail of `running` (F, then
E, then D) until A, B and C fit. Each victim goes to the front of `waiting`
(Scheduler._enqueue(front_of_class=True)), so they end up as [D, E, F] ahead of G: the seed's
`waiting.extendleft(reversed(preempted))`. They are later recomputed from their tokens.

Run: python examples/preemption_order.py [--trace FILE]"""

from collections import deque

from stub_runner import StubRunner, parse_args


def main() -> None:
    args = parse_args(__doc__)
    runner = StubRunner(policy="prefill_first", block_size=4, num_blocks=6, max_num_seqs=8,
                        max_num_batched_tokens=64, trace=args.trace)
    sched = runner.scheduler
    for name in "ABCDEFG":
        runner.add(name, 4, max_tokens=3)
    print("prefill_first, 6 KV blocks of 4 tokens; seven 4-token prompts A-G, 3 tokens each")

    runner.step()  # A-F prefilled, one block each; G finds no free block
    running, waiting = list(sched.running), list(sched.waiting)
    print(f"before step 1: running {runner.queue(running)}, waiting {runner.queue(waiting)}, "
          f"{runner.block_manager.num_free_blocks} free blocks")

    runner.step()
    victims = [s for s, _ in sched.preempted]
    in_running_order = [s for s in running if s in victims]
    seed = deque(waiting)
    seed.extendleft(reversed(in_running_order))  # the seed's way to requeue them
    print(f"after step 1:  running {runner.queue(sched.running)}, "
          f"waiting {runner.queue(sched.waiting)}")
    print(f"  preempted (tail first) {runner.queue(victims)}; at the head of waiting in their "
          f"running order {runner.queue(in_running_order)}, as "
          f"extendleft(reversed(...)) gives {runner.queue(seed)}")
    assert runner.queue(victims) == "[F, E, D]"
    assert list(sched.waiting) == list(seed) and runner.queue(seed) == "[D, E, F, G]"

    runner.run()
    print(f"done in {runner.num_steps} steps, {sched.num_preemptions} preemptions in all")
    runner.close()


if __name__ == "__main__":
    main()
