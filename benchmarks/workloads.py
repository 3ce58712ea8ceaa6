"""Every benchmark's requests: what is asked for, drawn from a seed.

Each generator keeps the draws, in order, of the script it came from, so a figure recorded
with a seed and arguments can be measured again on the same requests.
"""

import math
import random
from pathlib import Path

# Qwen3-0.6B's config.json: the shape of the random-weight model the GPU figures use
QWEN3_CONFIG = Path(__file__).resolve().parent / "qwen3_0_6b_config.json"
SEED_OUTPUT_TOKENS = 133_966  # seed_workload(256, 1024, 1024)'s max_tokens total, as bench.py's

SUBJECTS = [
    "the ocean", "volcanoes", "honeybees", "the Roman empire", "black holes", "bread baking",
    "chess", "glaciers", "the printing press", "octopuses", "jazz", "solar panels", "deserts",
    "the internet", "rainforests", "trains", "origami", "the moon", "tea", "robots",
]  # fmt: skip
TASKS = [
    "Write a detailed essay about {}.",
    "Explain {} to a curious ten-year-old, with examples.",
    "Tell a long story in which {} plays a central part.",
    "List everything you know about {}, one point per line.",
    "Describe the history of {} in as much detail as you can.",
]
# short chat questions with short answers (benchmarks/cpu_peer.py)
CHAT_QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "List three primary colors.", "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.", "Give me a synonym for happy.",
    "What is 12 times 12?", "Name a famous painting by Leonardo da Vinci.",
    "What does a compiler do?", "Suggest a name for a pet goldfish.",
    "Why is the sky blue?", "Describe a cat in five words.",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.",
    "How do airplanes stay in the air?", "What is the largest planet?",
]  # fmt: skip


def seed_workload(
    num_seqs: int, max_input_len: int, max_output_len: int
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py, draw for draw: random.seed(0) (the global generator, as bench.py);
    all prompts of randint(100, max_input_len) ids in [0, 10000] first, then all max_tokens of
    randint(100, max_output_len). At (256, 1024, 1024): SEED_OUTPUT_TOKENS."""
    random.seed(0)
    # bench.py draws lengths from 100; the floor only drops for lengths below 100 (tiny tests)
    lo_in, lo_out = min(100, max_input_len), min(100, max_output_len)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(lo_in, max_input_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [random.randint(lo_out, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def length_range(n: int, ratio: float) -> tuple[int, int]:
    """n +- ratio * n, widened to whole tokens."""
    return math.floor(n * (1 - ratio)), math.ceil(n * (1 + ratio))


def draw_length(rng: random.Random, lens: tuple[int, int]) -> int:
    """A length uniform in the inclusive range, at least 1 (a range may start at 0)."""
    return max(1, rng.randint(*lens))


def random_requests(
    num: int,
    input_lens: tuple[int, int],
    output_lens: tuple[int, int],
    token_ids: tuple[int, int],
    seed: int,
) -> list[tuple[list[int], int]]:
    """`num` (prompt, output length) pairs: lengths uniform in the inclusive ranges (at least
    1), token ids uniform in `token_ids` (inclusive); each request's output length is drawn
    before its prompt."""
    rng = random.Random(seed)
    lo, hi = token_ids
    reqs = []
    for _ in range(num):
        out_len = draw_length(rng, output_lens)
        ids = [rng.randint(lo, hi) for _ in range(draw_length(rng, input_lens))]
        reqs.append((ids, out_len))
    return reqs
