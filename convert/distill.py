"""Self-distillation data for ``train-heads``: the trunk's own replies to prompts.

Heads learn best from what the model actually produces (EAGLE-3, FastMTP): every
prompt goes through the trunk's chat template and the trunk answers it, greedily and,
for ``samples`` > 1, sampled. Each conversation becomes one training row (prompt, then
reply, padded), so its hidden states are the ones the runtime sees while decoding it,
and only reply positions are trained and scored (`reply_weights`): those are where
drafts are made.

The replies are generated in batches (mlx-lm's `BatchGenerator`) and appended to a
JSON-lines file, so an interrupted run resumes where it stopped. The built-in prompts
(`builtin_prompts`) are written for this package: code requests in several languages,
questions about Python's standard library modules by name, explanations, advice,
writing and everyday chat. Pass your own with ``--distill FILE`` (a line per prompt, or
JSON lines with ``prompt`` and ``kind``).
"""

import itertools
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from mlx_mtp.errors import MTPError

TEMP, TOP_P = 0.7, 0.95  # the sampled replies (the greedy one is sample 0)
KINDS = ("code", "chat")


@dataclass(frozen=True)
class Prompt:
    kind: str  # "code" or "chat": held-out agreement is reported per kind
    text: str
    train_only: bool = False  # never held out (`split_prompts`)


# --- the built-in prompt set ----------------------------------------------------------

CODE_TASKS = """reverses a string
checks whether a string is a palindrome
counts the vowels in a string
returns the n-th Fibonacci number
computes the factorial of a number
finds the largest element of a list
removes duplicates from a list while keeping the order
merges two sorted lists into one sorted list
flattens a nested list
counts how often each word appears in a text
checks whether two strings are anagrams
converts a temperature from Celsius to Fahrenheit
computes the greatest common divisor of two numbers
returns all prime numbers below n
performs a binary search on a sorted list
sorts a list with insertion sort
sorts a list with merge sort
sorts a list with quicksort
reads a CSV file and returns its rows as dictionaries
writes a list of dictionaries to a JSON file
validates an email address with a regular expression
parses a date string and returns the day of the week
computes the average of a list of numbers
finds the median of a list
rotates a matrix by 90 degrees
transposes a matrix
multiplies two matrices
checks whether parentheses in a string are balanced
converts a Roman numeral to an integer
converts an integer to binary
computes the sum of the digits of a number
capitalizes the first letter of every word
finds the longest common prefix of a list of strings
returns the intersection of two lists
groups a list of words by their first letter
chunks a list into pieces of size n
implements a stack with push and pop
implements a queue using two stacks
implements a simple linked list
computes the edit distance between two strings
finds the two numbers in a list that add up to a target
checks whether a year is a leap year
generates a random password
counts the lines in a file
finds the most common element in a list
computes the power set of a set
returns the running total of a list
checks whether a number is a perfect square
implements a least-recently-used cache
downloads a web page and counts its links
retries a function call with exponential backoff
measures how long a function takes to run
memoizes a recursive function
splits a sentence into words and removes punctuation
computes the distance between two points
finds all files with a given extension in a folder
formats a number of bytes as a human-readable size
checks whether a binary tree is balanced
performs a breadth-first search on a graph
finds the shortest path in a grid
parses command-line arguments for a small tool""".splitlines()

LANGUAGES = ["Python"] * 6 + ["JavaScript", "C", "Rust", "Go", "Java", "TypeScript"]

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "How do I write a {lang} function that {task}?",
    "Write a {lang} function that {task}, and explain how it works.",
    "Show me a short {lang} example of a function that {task}.",
    "Write a {lang} function that {task}. Include a docstring and a test.",
]

MODULE_TEMPLATES = [
    "What does the Python module `{m}` do? Show an example.",
    "Give a short example of using Python's `{m}` module.",
    "When should I use the `{m}` module in Python?",
]

TOPICS = """photosynthesis
the water cycle
black holes
how vaccines work
inflation in economics
the French Revolution
machine learning
how the internet works
climate change
the immune system
plate tectonics
how a compiler works
the theory of evolution
compound interest
how airplanes fly
the Roman Empire
quantum computing
the stock market
how batteries store energy
the human heart
recycling
volcanoes
the Renaissance
how a database index works
public key cryptography
the moon's phases
sleep and memory
how bread rises
the printing press
renewable energy""".splitlines()

TOPIC_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.",
    "How would you explain {t} to a ten-year-old?",
    "Write a short summary of {t}.",
    "Why is {t} important?",
    "What are common misconceptions about {t}?",
    "Tell me about {t}.",
    "Write a short quiz with three questions about {t}.",
    "Describe {t} in one paragraph, then define two key terms.",
]

ACTIVITIES = """learning a new language
running a first marathon
saving money each month
studying for an exam
starting a vegetable garden
staying focused while working from home
preparing for a job interview
cooking healthy meals on a budget
improving my sleep
public speaking
making new friends in a new city
writing a good resume
learning to play the guitar
keeping a houseplant alive
travelling with a small backpack""".splitlines()

ACTIVITY_TEMPLATES = [
    "Give me some tips for {a}.",
    "What are the most common mistakes when {a}?",
    "Make a one-week plan for {a}.",
    "How should I get started with {a}?",
    "What do I need for {a}?",
]

WRITING = """a short story about a robot who learns to paint
a poem about the ocean at night
a thank-you email to a colleague who helped me with a project
a short story about a lost cat finding its way home
a product description for a reusable water bottle
a polite email asking my landlord to fix the heating
a limerick about a programmer
a short speech for a friend's wedding
a cover letter for a junior software developer position
a haiku about autumn leaves
a short dialogue between a customer and a barista
a bedtime story about a brave little mouse
a review of an imaginary science fiction film
a motivational message for a friend starting a new job
a short blog post about the benefits of walking""".splitlines()

QUESTIONS = """What is the difference between a list and a tuple in Python?
What is the difference between TCP and UDP?
Why is the sky blue?
How many planets are in the solar system, and what are they?
What is the capital of Australia, and why is it not Sydney?
What are the benefits of regular exercise?
How do I make a cup of good coffee?
What is a good way to learn programming?
What causes the seasons on Earth?
How does a refrigerator keep food cold?
What is the difference between weather and climate?
Why do cats purr?
What should I pack for a weekend hiking trip?
How do I politely decline an invitation?
What is the Pythagorean theorem?
What is recursion in programming?
What is the difference between git merge and git rebase?
How does garbage collection work in Python?
What is a REST API?
What are the main differences between Python 2 and Python 3?
How do I center a div in CSS?
What is Big O notation?
Hello! What can you help me with?
Can you recommend a few classic novels to read?
What is a healthy breakfast?""".splitlines()


# Chat prompts added after the first demo heads were trained: they only train, so the
# held-out split (`split_prompts`) stays the one every published curve was scored on.
MORE_TOPICS = """the solar system
how rainbows form
the Great Wall of China
how the heart pumps blood
the history of the bicycle
how earthquakes are measured
the life cycle of a butterfly
how tides work
the Industrial Revolution
how glasses correct vision
the Olympic Games
how honeybees make honey
the ancient Egyptians
how a car engine works
the invention of the telephone
how clouds form
the Amazon rainforest
how money is printed
the human brain
how a microwave oven heats food
the first moon landing
how coral reefs grow
the history of chess
how wind turbines make electricity
the digestive system
how seeds become plants
the Silk Road
how snowflakes form
the history of jazz
how a bill becomes a law
the Northern Lights
how fish breathe underwater
the Great Barrier Reef
how the eye sees color
the history of the Internet
how muscles grow stronger
the desert ecosystem
how a camera takes a picture
the Middle Ages
how bridges stay up
dinosaurs
how email works
the ocean's deepest places
how plants drink water
the history of writing""".splitlines()

MORE_ACTIVITIES = """training a puppy
baking sourdough bread
learning to swim as an adult
planning a birthday party
organizing a small closet
reading more books
starting to run in the morning
learning to draw
moving to a new apartment
taking better photos with a phone
planning a road trip
writing a daily journal
learning to cook rice
keeping a tidy desk
meditating for the first time
teaching a child to ride a bike
hosting a dinner for friends
growing tomatoes on a balcony
drinking more water every day
learning to type faster""".splitlines()

MORE_WRITING = """a short story about a dragon who is afraid of the dark
a poem about a rainy afternoon
an email inviting my team to a lunch on Friday
a short story about two friends who find a map
a birthday message for my grandmother
a short poem about mountains in winter
a note apologising for missing a meeting
a short fable about a fox and a crow
a welcome message for new members of a book club
a short story about a girl who can talk to birds
a toast for a retirement party
a postcard from a trip to the seaside
a short poem about a city at dawn
a text message asking a neighbour to water my plants
a short mystery story set in a library
an introduction for a talk about healthy habits
a short story about a time traveller who visits a market
a poem about friendship
a letter to my future self
a short scene where two strangers share an umbrella""".splitlines()

MORE_QUESTIONS = """What is the tallest mountain in the world?
Why do leaves change color in autumn?
How long does it take light from the Sun to reach Earth?
What is the difference between a virus and a bacterium?
Why do we dream?
How do birds know where to migrate?
What is the best way to remember new words?
Why is the ocean salty?
How do I make a simple tomato sauce?
What is the difference between a lake and a pond?
How often should I water a cactus?
Why do onions make people cry?
What is a good name for a golden retriever puppy?
How can I be more productive in the morning?
What is the difference between a crocodile and an alligator?
Why do we have leap years?
How do I write a good thank-you note?
What are some fun things to do on a rainy day?
How do airplanes stay in the air?
What is the difference between baking soda and baking powder?
Why do stars twinkle?
How can I calm down before an exam?
What is the largest animal on Earth?
How do I start learning to play chess?
What is a balanced diet?
Why is the Moon sometimes visible during the day?
What are good questions to ask at the end of a job interview?
How do I keep my phone battery healthy?
What is the difference between a hurricane and a tornado?
Can you suggest a simple weekly workout routine?
How does a bicycle stay upright?
What is the meaning of the word "serendipity"?
How do I say no to extra work politely?
What are the main food groups?
Why do we yawn?
How do I plan a budget for a holiday?
What makes a good friend?
How do magnets work?
What should I do if I cannot fall asleep?
How do I choose a good watermelon?""".splitlines()


def more_chat_prompts() -> List[Prompt]:
    """Training-only chat prompts (`MORE_TOPICS` ...), in a fixed order."""
    texts = [t.format(t=x) for x in MORE_TOPICS for t in TOPIC_TEMPLATES]
    texts += [t.format(a=a) for a in MORE_ACTIVITIES for t in ACTIVITY_TEMPLATES]
    texts += [f"Write {w}." for w in MORE_WRITING] + MORE_QUESTIONS
    return [Prompt("chat", t, train_only=True) for t in texts]


def builtin_prompts() -> List[Prompt]:
    """The built-in prompt set, in a fixed order: code requests (every task in every
    language, the phrasing rotating), standard-library questions, chat, then the
    training-only chat prompts (`more_chat_prompts`)."""
    pairs = itertools.product(CODE_TASKS, LANGUAGES)
    code = [
        Prompt("code", CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(lang=l, task=t))
        for i, (t, l) in enumerate(pairs)
    ]
    modules = sorted(
        m for m in sys.stdlib_module_names if not m.startswith("_") and "." not in m
    )
    code += [
        Prompt("code", MODULE_TEMPLATES[i % len(MODULE_TEMPLATES)].format(m=m))
        for i, m in enumerate(modules)
    ]
    chat = [Prompt("chat", t.format(t=x)) for x in TOPICS for t in TOPIC_TEMPLATES]
    chat += [
        Prompt("chat", t.format(a=a)) for a in ACTIVITIES for t in ACTIVITY_TEMPLATES
    ]
    chat += [Prompt("chat", f"Write {w}.") for w in WRITING]
    chat += [Prompt("chat", q) for q in QUESTIONS]
    seen = {p.text for p in code + chat}
    more = [p for p in more_chat_prompts() if p.text not in seen]
    return list(dict.fromkeys(code + chat + more))


def read_prompts(source: str) -> List[Prompt]:
    """``builtin`` (`builtin_prompts`), or a file: one prompt per line, or JSON lines
    ``{"prompt": ..., "kind": "code" | "chat"}`` (kind defaults to chat)."""
    if source == "builtin":
        return builtin_prompts()
    path = Path(source).expanduser()
    if not path.is_file():
        raise MTPError(f"no such prompts file: {path}")
    prompts = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(Prompt("chat", line.strip()))
            continue
        try:
            record = json.loads(line)
            text, kind = record["prompt"], record.get("kind", "chat")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise MTPError(
                f"{path}:{n}: not a prompt (a line of text, or JSON with 'prompt')"
            ) from None
        if kind not in KINDS or not isinstance(text, str) or not text.strip():
            raise MTPError(f"{path}:{n}: 'kind' is code or chat, 'prompt' is text")
        prompts.append(Prompt(kind, text))
    if not prompts:
        raise MTPError(f"{path} holds no prompts")
    return prompts


def split_prompts(prompts: List[Prompt], held_out: float, seed: int):
    """Deterministic split of the prompts: (train, held-out), at least one held out
    per kind when ``held_out`` > 0; the training prompts shuffled, kinds mixed. The
    held-out prompts are drawn from those not marked ``train_only``, so adding those
    never changes the held-out set."""
    train, held = [], []
    for kind in KINDS:
        group = [p for p in prompts if p.kind == kind and not p.train_only]
        random.Random(seed).shuffle(group)
        n = max(1, int(round(len(group) * held_out))) if held_out and group else 0
        held += group[:n]
        train += group[n:]
    train += [p for p in prompts if p.train_only]
    random.Random(seed + 1).shuffle(train)
    return train, held


# --- generation -----------------------------------------------------------------------


def encode(tokenizer, prompt: Prompt) -> List[int]:
    """The prompt as the runtime sends it: through the chat template when the
    tokenizer has one."""
    if getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": prompt.text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt.text))


def generate_replies(
    model,
    tokenizer,
    prompts: List[Prompt],
    samples: int,
    max_len: int,
    path: Path,
    seed: int,
    limit: Optional[int] = None,
    batch_size: int = 64,
    progress: bool = True,
) -> List[dict]:
    """The trunk's replies to every prompt, ``samples`` each (sample 0 greedy, the
    others sampled at `TEMP`, `TOP_P`), each conversation at most ``max_len`` tokens
    (a prompt longer than half of that keeps its end), in the order (sample,
    prompt): every prompt's greedy reply first. With ``limit``, only until the
    conversations hold that many tokens (whole batches).
    Appended to the JSON-lines ``path`` as they finish, a batch at a time, and read
    back from it on a rerun (the same batches: the same replies): records
    ``{"prompt", "sample", "kind", "tokens", "reply_start"}``."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler
    from tqdm import tqdm

    done = _read_replies(path)
    jobs = [(i, s) for s in range(samples) for i in range(len(prompts))]
    encoded, made = {}, []
    bar = tqdm(
        total=len(jobs),
        initial=0,
        desc="replies",
        unit="reply",
        disable=not progress,
    )
    eos = [[t] for t in tokenizer.eos_token_ids]
    with path.open("a") as out:
        for start in range(0, len(jobs), batch_size):
            if limit and sum(len(r["tokens"]) for r in made) >= limit:
                break
            batch = jobs[start : start + batch_size]  # fixed batches: resumes exactly
            if all(job in done for job in batch):
                made += [done[job] for job in batch]
                bar.update(len(batch))
                continue
            for i, _ in batch:
                if i not in encoded:
                    encoded[i] = encode(tokenizer, prompts[i])[-(max_len // 2) :]
            mx.random.seed(seed * 1_000_003 + start)
            gen = BatchGenerator(
                model.trunk,
                stop_tokens=eos,
                completion_batch_size=len(batch),
                prefill_batch_size=min(len(batch), 16),
            )
            uids = gen.insert(
                [encoded[i] for i, _ in batch],
                [max_len - len(encoded[i]) for i, _ in batch],
                samplers=[
                    None if s == 0 else make_sampler(temp=TEMP, top_p=TOP_P)
                    for _, s in batch
                ],
            )
            replies = {uid: [] for uid in uids}
            while responses := gen.next_generated():
                for r in responses:
                    replies[r.uid].append(int(r.token))  # the stop token too
            gen.close()
            for uid, (i, s) in zip(uids, batch):
                record = {
                    "prompt": i,
                    "sample": s,
                    "kind": prompts[i].kind,
                    "tokens": encoded[i] + replies[uid],
                    "reply_start": len(encoded[i]),
                }
                out.write(json.dumps(record) + "\n")
                done[(i, s)] = record
                made.append(record)
            out.flush()
            bar.update(len(batch))
    bar.close()
    return made


def _read_replies(path: Path) -> Dict[Tuple[int, int], dict]:
    """The records a previous run wrote (a torn last line is dropped)."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(r["prompt"], r["sample"])] = r
    return done


def conversation_rows(
    records: List[dict], length: int, pad: int, kind: Optional[str] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """One row per conversation, ``(n, length)`` tokens padded with ``pad``, and
    `reply_weights` for it: ``(tokens, weights)``."""
    records = [r for r in records if kind is None or r["kind"] == kind]
    tokens = np.full((len(records), length), pad, dtype=np.int32)
    weights = np.zeros((len(records), length), dtype=np.uint8)
    for n, r in enumerate(records):
        t = r["tokens"][:length]
        tokens[n, : len(t)] = t
        weights[n] = reply_weights(r["reply_start"], len(t), length)
    return tokens, weights


def reply_weights(reply_start: int, end: int, length: int) -> np.ndarray:
    """``(length,)``: 1 where the trunk's greedy token at a position is the target of a
    draft in the reply (positions ``reply_start``.. ``end``-2: the prediction of reply
    tokens 2.. onwards; the first is the prefill's, not a draft's), else 0."""
    w = np.zeros(length, dtype=np.uint8)
    w[reply_start : max(reply_start, end - 1)] = 1
    return w
