#!/usr/bin/env python3
"""Writes the conversations the bundled model answers to make the EAGLE-3 head's training data
(`train_draft_head generate-tokens`): chat questions, writing tasks, rewrites, code and small
reasoning tasks, one to four user turns each (later turns are follow-ups the target answers
with its own earlier answers as history), each with its sampling temperature. All of our own
writing: the lists of scripts/make-train-prompts.py plus the extra lists below, combined with a
fixed seed (the same file on every run). None of the topics or texts is taken from the
evaluation workloads in docs/workloads/.

Usage: make-eagle3-conversations.py OUT.jsonl [COUNT]      (default COUNT: 12000)

Each line: {"conv": i, "kind": k, "temperature": t, "top_p": p, "turns": ["...", ...]}.
Temperatures: a third greedy (t = 0, top_p = 1), a third t = 0.7 with top-p 0.9, a third t = 1.0
with top-p 0.95, in turn by conversation index.
"""
import importlib.util
import json
import os
import random
import sys

_spec = importlib.util.spec_from_file_location(
    "base", os.path.join(os.path.dirname(os.path.abspath(__file__)), "make-train-prompts.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

TOPICS = base.TOPICS + [
    "beekeeping", "the printing press", "volcanoes", "tides", "penguins", "coffee roasting",
    "the water cycle", "electric cars", "board games", "the human heart", "comets", "wind turbines",
    "sourdough", "the Silk Road", "maple syrup", "bicycles", "chess openings", "the moon landing",
    "rainforests", "sleep", "microplastics", "railways", "sign language", "the Vikings",
    "telescopes", "composting", "wildfires", "the stomach", "solar panels", "street food",
    "paper making", "the ocean floor", "caves", "mathematics puzzles", "libraries", "whales",
    "bridges", "nutrition labels", "weather forecasts", "frogs", "crystals", "language learning",
    "the alphabet", "bats", "photography", "running shoes", "clocks", "the blood", "ants",
    "cartography", "ice cream", "the Middle Ages", "houseplants", "meditation", "auroras",
    "rice farming", "dolphins", "hot air balloons", "the keyboard", "calendars", "glass making",
    "the postal service", "bees and flowers", "saving money", "first aid", "time zones",
    "carnivorous plants", "mosaics", "trains in Japan", "olive oil", "tornadoes", "the ear",
]

CHAT = base.CHAT + [
    "I am new to {t}. Where should I start?",
    "What are the three most important things to understand about {t}?",
    "Explain {t} as if you were a museum guide.",
    "Write a short speech about {t} for a school assembly.",
    "What questions are scientists still asking about {t}?",
    "Give me a step-by-step guide to learning about {t} in one month.",
    "What would the world be like without {t}?",
    "Write a limerick about {t}.",
    "Write a diary entry of someone who spends a day learning about {t}.",
    "List the pros and cons of {t} in a table.",
    "What are some surprising connections between {t} and {u}?",
    "Write a short news article about a new discovery related to {t}.",
    "Explain {t} using an everyday analogy.",
    "What are five words that are useful when talking about {t}? Define each.",
    "Write a letter to a friend describing why you became interested in {t}.",
    "Plan a one-hour lesson about {t} for teenagers.",
]

WRITING = [
    "Write a short story about {p} who finds {o}.",
    "Write a poem about {p} and {o}.",
    "Write the opening paragraph of a mystery novel about {p} and {o}.",
    "Write a fairy tale in which {p} loses {o}.",
    "Write a funny dialogue between {p} and a talking cat about {o}.",
    "Write a thank-you note from {p} to a neighbour who returned {o}.",
    "Describe a rainy afternoon from the point of view of {p} holding {o}.",
    "Write a short scene for a play: {p} tries to sell {o} at a market.",
]
PEOPLE = ["baker", "sailor", "young inventor", "retired teacher", "lighthouse keeper", "gardener",
          "detective", "astronaut", "street musician", "librarian", "farmer", "painter", "chef",
          "train driver", "shy student", "old fisherman", "mail carrier", "robot", "knight", "nurse"]
OBJECTS = ["a map hidden in a book", "a broken clock", "a key that opens nothing", "a jar of stars",
           "a letter from the future", "a tiny dragon", "an umbrella that talks", "a golden seed",
           "a lost photograph", "a music box", "a compass that points home", "a red balloon",
           "a bag of strange coins", "a forgotten diary", "a glowing stone", "a paper boat"]

ADVICE = [
    "How can I {a}?", "What are some practical tips to {a}?", "I want to {a}. Can you make me a plan?",
    "What mistakes should I avoid when I try to {a}?", "Give me five ideas to {a}.",
]
ACTIONS = ["sleep better", "save money on groceries", "stay focused while studying",
           "prepare for a job interview", "keep my room tidy", "make new friends in a new city",
           "start running", "drink more water", "learn to cook simple meals", "write a good essay",
           "organize a birthday party", "reduce stress at work", "learn a new language faster",
           "take better photos with my phone", "grow tomatoes on a balcony", "plan a road trip",
           "read more books", "speak more confidently in meetings", "waste less food",
           "keep a journal"]

MORE_CODE_TASKS = [
    "finds the longest word in a sentence", "converts a number to binary", "checks whether two "
    "strings are anagrams", "rotates a list by k positions", "computes the sum of the digits of a "
    "number", "counts the words in a string", "returns the intersection of two lists",
    "checks whether a year is a leap year", "finds the index of an element with binary search",
    "transposes a matrix", "converts a string to title case", "generates the first n prime numbers",
    "parses a comma-separated line into fields", "computes the median of a list",
    "implements a simple stack with push and pop", "removes whitespace from both ends of a string",
]
CODE_TASKS = base.CODE_TASKS + MORE_CODE_TASKS
LANGS = base.LANGS + ["TypeScript", "C++", "Ruby"]
CODE = base.CODE + [
    "Write a {l} program that {c}, and explain how it works.",
    "Implement a function in {l} that {c}. Mention its time complexity.",
]
MORE_SNIPPETS = [
    "def mean(xs):\n    return sum(xs) / len(xs)",
    "let total = 0;\nfor (let i = 0; i < items.length; i++) {\n  total += items[i].price;\n}",
    "def find(xs, target):\n    for i in range(len(xs)):\n        if xs[i] == target:\n            return i\n    return -1",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY COUNT(*) DESC;",
    "while True:\n    line = input()\n    if line == 'quit':\n        break\n    print(line.upper())",
]
SNIPPETS = base.SNIPPETS + MORE_SNIPPETS
CODE_Q = base.CODE_Q + ["How could this code fail? Suggest a safer version.\n\n{s}",
                        "Add comments to this code:\n\n{s}"]

MORE_SENTENCES = [
    "The library will stay open until nine in the evening.", "A new reading room was added on the second floor.",
    "Students often meet there to prepare for exams.", "The librarians organize a book fair every spring.",
    "Our neighbour repaired his old bicycle last weekend.", "He replaced the chain and painted the frame blue.",
    "Now he rides it to the market every Saturday.", "His daughter wants to learn to ride it too.",
    "The hiking club met at the station at seven.", "The trail climbed slowly through a pine forest.",
    "At the top they ate sandwiches and watched the clouds.", "Everyone was tired but happy on the way back.",
    "The company moved into a larger office in March.", "Each team now has its own meeting room.",
    "The kitchen is bigger and has a new coffee machine.", "Employees voted to keep the plants from the old office.",
]
SENTENCES = base.SENTENCES + MORE_SENTENCES
REWRITE = base.REWRITE + [
    "Rewrite the following text in a cheerful tone:\n\n{p}",
    "Rewrite the following text as a short news report:\n\n{p}",
    "Make the following text shorter without losing any facts:\n\n{p}",
]
REASON = base.REASON + [
    "A box holds {b} books. How many boxes are needed for {a} books? Explain.",
    "If today is Monday, what day will it be in {a} days? Show your reasoning.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Tom is {b} years old and his sister is {a} years older. How old will she be in {b} years?",
]

FOLLOW_GENERIC = [
    "Can you explain that in simpler words?", "Make it shorter, please.", "Can you give me an example?",
    "Thanks! Can you add one more idea?", "Why is that?", "Can you turn your answer into a list?",
    "What is the most important point of your answer?", "Can you say more about the first point?",
    "Rewrite your answer in a more formal style.", "Is there anything you left out?",
    "Great. Now summarize everything in two sentences.", "Can you explain the second part in more detail?",
    "How would you explain this to a ten-year-old?", "What would be a good title for your answer?",
]
FOLLOW = {
    "chat": ["What do experts disagree about here?", "Can you recommend a way to learn more?",
             "Write a short quiz based on your answer."],
    "writing": ["Give it a happier ending.", "Continue the story.", "Make it rhyme.",
                "Rewrite it from the other character's point of view.", "Give it a title."],
    "advice": ["Which of these is the easiest to start with?", "Make it a weekly schedule.",
               "What if I only have ten minutes a day?"],
    "code": ["Add error handling.", "Write a test for it.", "What is its time complexity?",
             "Rewrite it in {l2}.", "Can you make it shorter?", "Explain each line."],
    "codeq": ["Now show the fixed version.", "Write a test for it.", "Rewrite it in {l2}."],
    "rewrite": ["Now make it more casual.", "Make it even shorter.", "Translate it into a list of facts.",
                "Write it as a short email."],
    "reason": ["Check your answer again step by step.", "What if the numbers were doubled?",
               "Explain it in a different way.", "Write a similar problem for me to solve."],
}
SAMPLING = [(0.0, 1.0), (0.7, 0.9), (1.0, 0.95)]


def first_turn(rng, k):
    if k == "chat":
        t, u = rng.sample(TOPICS, 2)
        return rng.choice(CHAT).format(t=t, u=u)
    if k == "writing":
        who = rng.choice(PEOPLE)
        who = ("an " if who[0] in "aeiou" else "a ") + who
        return rng.choice(WRITING).format(p=who, o=rng.choice(OBJECTS))
    if k == "advice":
        return rng.choice(ADVICE).format(a=rng.choice(ACTIONS))
    if k == "code":
        return rng.choice(CODE).format(l=rng.choice(LANGS), c=rng.choice(CODE_TASKS))
    if k == "codeq":
        return rng.choice(CODE_Q).format(s=rng.choice(SNIPPETS))
    if k == "rewrite":
        start = rng.randrange(0, len(SENTENCES) - 3)
        para = " ".join(SENTENCES[start:start + rng.randint(3, 5)])
        return rng.choice(REWRITE).format(p=para)
    return rng.choice(REASON).format(a=rng.randint(2, 90), b=rng.randint(2, 15))


def follow_ups(rng, k, n):
    pool = FOLLOW_GENERIC + FOLLOW[k]
    return [p.format(l2=rng.choice(LANGS)) for p in rng.sample(pool, n)]


def main() -> None:
    out = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 12000
    rng = random.Random(20261202)
    kinds = (["chat"] * 9 + ["writing"] * 3 + ["advice"] * 2 + ["code"] * 3 + ["codeq"] * 1
             + ["rewrite"] * 3 + ["reason"] * 1)
    seen = set()
    convs = []
    while len(convs) < count:
        k = rng.choice(kinds)
        p = first_turn(rng, k)
        if p in seen and rng.random() < 0.8:
            continue  # a repeated first turn only now and then (it gets other follow-ups)
        seen.add(p)
        extra = rng.choice([0, 0, 1, 1, 2, 3])  # 1-4 turns, two thirds multi-turn
        temp, top_p = SAMPLING[len(convs) % len(SAMPLING)]
        convs.append({"conv": len(convs), "kind": k, "temperature": temp, "top_p": top_p,
                      "turns": [p] + follow_ups(rng, k, extra)})
    with open(out, "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    turns = sum(len(c["turns"]) for c in convs)
    print(f"wrote {out} ({len(convs)} conversations, {turns} turns, {len(seen)} distinct first turns)")


if __name__ == "__main__":
    main()
