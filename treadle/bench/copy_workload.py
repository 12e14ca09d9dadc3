"""The copy-heavy workload (`--workload copy-edit`): requests whose answer repeats much of the
prompt, what speculative decoding by prompt lookup is for. Each prompt, through the model's chat
template, asks either to rewrite a passage with one word changed, or to extract the fields of a
list of records as JSON lines; the output length is the passage's (or the records') token count,
about what a faithful answer takes.

Passages are sentences drawn from small word lists (the engineer repaired the bridge near the
river on Monday.): plain English that a small model copies, deterministic by seed.
"""

from __future__ import annotations

import random

from treadle.bench.workloads import BenchRequest
from treadle.tokenizer import Tokenizer

SUBJECTS = ("the engineer", "a teacher", "the old farmer", "my neighbour", "the pilot",
            "a young doctor", "the mayor", "our guide", "the baker", "a student")
VERBS = ("repaired", "painted", "visited", "described", "measured", "cleaned", "photographed",
         "inspected", "sold", "carried")
OBJECTS = ("the bridge", "a small boat", "the library", "an empty house", "the garden wall",
           "a wooden table", "the train station", "a red bicycle", "the school roof",
           "a stone tower")
PLACES = ("near the river", "in the city centre", "behind the market", "on the hill",
          "next to the harbour", "by the forest", "at the end of the street", "in the valley")
TIMES = ("on Monday", "last winter", "early in the morning", "after the storm",
         "before lunch", "during the festival", "in the spring", "late at night")
NAMES = ("Alice Martin", "Bruno Rossi", "Chen Wei", "Dana Cohen", "Emil Novak", "Fatima Haddad",
         "Gustav Berg", "Hana Sato", "Ivan Petrov", "Julia Costa")
CITIES = ("Lisbon", "Oslo", "Kyoto", "Denver", "Nairobi", "Lyon", "Krakow", "Austin")
JOBS = ("nurse", "architect", "chef", "plumber", "librarian", "pilot", "farmer", "lawyer")
MIN_LEN, MAX_LEN = 300, 1000  # the copied text's tokens


def sentence(rng: random.Random) -> str:
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} " \
           f"{rng.choice(PLACES)} {rng.choice(TIMES)}."
    return text[0].upper() + text[1:]


def record(rng: random.Random) -> str:
    return (f"{rng.choice(NAMES)} is a {rng.randint(22, 70)}-year-old {rng.choice(JOBS)} who "
            f"lives in {rng.choice(CITIES)}.")


def grow(tokenizer: Tokenizer, rng: random.Random, unit, target: int) -> tuple[str, int]:
    """Units joined by spaces until the text has at least `target` tokens: text, tokens."""
    parts: list[str] = []
    num_tokens = 0
    while num_tokens < target:
        parts.append(unit(rng))
        num_tokens = len(tokenizer(" ".join(parts), add_special_tokens=False)["input_ids"])
    return " ".join(parts), num_tokens


def copy_edit(tokenizer: Tokenizer, num_prompts: int, seed: int = 0,
              max_output_len: int | None = None, with_text: bool = True
              ) -> list[BenchRequest]:
    """`num_prompts` requests, rewrite and extract alternating, the copied text's length
    uniform in MIN_LEN..MAX_LEN tokens (at most `max_output_len` generated)."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    rng = random.Random(f"treadle-copy-edit-{seed}")
    requests = []
    for i in range(num_prompts):
        target = rng.randint(MIN_LEN, MAX_LEN)
        if i % 2 == 0:
            passage, length = grow(tokenizer, rng, sentence, target)
            old, new = rng.choice(OBJECTS), rng.choice(OBJECTS)
            ask = (f"Rewrite the passage below exactly as it is, except replace every "
                   f'"{old}" with "{new}". Output only the rewritten passage.\n\n{passage}')
        else:
            records, length = grow(tokenizer, rng, record, target)
            ask = ("Extract every person below as one JSON object per line, with the keys "
                   f'"name", "age", "job" and "city", in the order given.\n\n{records}')
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=True,
                                            add_generation_prompt=True)
        output_len = min(length, max_output_len) if max_output_len else length
        requests.append(BenchRequest(ids, output_len, tokenizer.decode(ids) if with_text
                                     else None))
    return requests
