"""Built-in tasks: prompts made in code, each with the label its reward compares against.

``toy_copy``: the prompt is a few digits (``data.toy_digits``, one by default)
and "=", the answer repeats them (the tiny demo's task, learnable by a random
model; with more digits the response has as many tokens, so the estimators
that differ per token or per sequence differ there). ``arithmetic``: short word
problems with small whole numbers, adding or taking away, the answer as the
label; pretrained small models get a few in ten right at temperature 1, so
GRPO has room to improve them. Both are deterministic in (count, seed).
"""

from __future__ import annotations

import random

Records = list[tuple[str, str]]

TOY_ALPHABET = "0123456789"

NAMES = ("Tom", "Ana", "Lee", "Mia", "Sam", "Zoe", "Ben", "Ivy")
ITEMS = ("apples", "books", "coins", "pens", "shells", "stamps", "cards", "eggs")
# (template, whether the answer is a + b rather than a - b)
ARITHMETIC_TEMPLATES = (
    ("What is {a} plus {b}?", True),
    ("What is {a} minus {b}?", False),
    ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", True),
    ("{name} has {a} {item} and gives {b} away. How many {item} are left?", False),
    ("There are {a} {item} in a box. {name} puts in {b} more. How many {item} are in the box?", True),
    ("A shelf holds {a} {item}. {name} takes {b} of them. How many {item} stay on the shelf?", False),
)
ARITHMETIC_MAX = 9


def toy_copy(count: int, seed: int, digits: int) -> Records:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        answer = "".join(rng.choice(TOY_ALPHABET) for _ in range(digits))
        records.append((f"{answer}=", answer))
    return records


def arithmetic(count: int, seed: int) -> Records:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        template, adds = rng.choice(ARITHMETIC_TEMPLATES)
        a, b = rng.randint(1, ARITHMETIC_MAX), rng.randint(1, ARITHMETIC_MAX)
        if not adds and b > a:
            a, b = b, a
        text = template.format(a=a, b=b, name=rng.choice(NAMES), item=rng.choice(ITEMS))
        records.append((text, str(a + b if adds else a - b)))
    return records
