#!/usr/bin/env python3
"""Writes the prompts the bundled model answers to make the draft head's training data
(scripts/train-draft-head.sh): chat questions, writing tasks, rewrites of short texts, code
questions and small reasoning tasks, all of our own writing, combined from the lists below with
a fixed seed (the same file on every run). None of the topics or texts is taken from the
evaluation workloads in docs/workloads/.

Usage: make-train-prompts.py OUT.jsonl [COUNT]
"""
import json
import random
import sys

TOPICS = [
    "glaciers", "the stock market", "honey", "sailing", "the Roman Empire", "vaccines", "jazz music",
    "black holes", "gardening in small spaces", "the internet", "dinosaurs", "climate change", "yoga",
    "pizza", "the Olympic Games", "earthquakes", "owls", "renewable energy", "the French Revolution",
    "smartphones", "coral reefs", "mountain hiking", "cheese making", "the immune system", "robots",
    "ancient Egypt", "wolves", "budget travel", "origami", "the periodic table", "bread yeast",
    "public speaking", "video games", "the Great Wall of China", "elephants", "tea", "rainbows",
    "the human brain", "airplanes", "knitting", "photosynthesis", "the Amazon river", "chocolate",
    "marathon training", "the solar system", "friendship", "camping", "democracy", "octopuses",
    "cloud computing", "mushrooms", "the Renaissance", "hurricanes", "dogs", "cats", "snow",
    "minimalism", "lighthouses", "the violin", "bamboo", "recycling electronics", "skateboarding",
    "volunteering", "the Arctic", "spices", "artificial intelligence", "castles", "sharks",
    "remote work", "fermentation", "birds migrating", "the metric system", "rivers", "sunflowers",
    "kites", "pottery", "submarines", "the night sky", "deserts", "fossils", "a healthy breakfast",
]

CHAT = [
    "What is {t}? Explain in simple words.",
    "Tell me three interesting facts about {t}.",
    "Why do people find {t} interesting?",
    "Can you explain the basics of {t}?",
    "Write a short introduction to {t} for beginners.",
    "What are the benefits and drawbacks of {t}?",
    "Give me a list of five questions a student might ask about {t}, with short answers.",
    "Describe {t} in one paragraph.",
    "How would you explain {t} to a child?",
    "What should I know before getting started with {t}?",
    "Write a short poem about {t}.",
    "Write a short story in which {t} plays an important role.",
    "Write a friendly email inviting a colleague to a talk about {t}.",
    "Summarize the most important ideas about {t} in bullet points.",
    "What is a common myth about {t}, and what is the truth?",
    "Compare {t} and {u}. How are they similar and how are they different?",
    "Write a dialogue between two friends discussing {t}.",
    "Suggest a weekend plan for someone who loves {t}.",
    "Write a product description for a book about {t}.",
    "What are some good tips for learning more about {t}?",
    "Create a simple quiz with three multiple-choice questions about {t}.",
    "Write a tweet about {t}.",
    "Explain the history of {t} briefly.",
    "What careers are related to {t}?",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
    "returns the largest element of a list", "computes the factorial of n", "merges two sorted lists",
    "removes duplicates from a list while keeping the order", "converts Celsius to Fahrenheit",
    "checks whether a word is a palindrome", "computes the average of a list of numbers",
    "returns the n-th Fibonacci number", "counts how often each word appears in a text",
    "finds the second smallest number in a list", "flattens a list of lists",
    "validates that a string looks like an email address", "sorts a list of dictionaries by a key",
    "reads a text file and returns the number of lines", "computes the greatest common divisor",
    "capitalizes the first letter of every word", "splits a list into chunks of size k",
]
LANGS = ["Python", "JavaScript", "Rust", "C", "Java", "Go"]
CODE = [
    "Write a {l} function that {c}.",
    "Show me how to write a {l} function that {c}, and explain it.",
    "How do I write code in {l} that {c}? Keep it short.",
    "Write a {l} function that {c}, with a docstring or comment and one example call.",
]
SNIPPETS = [
    "def f(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n            total += x\n    return total",
    "function g(s) {\n  return s.split('').reverse().join('');\n}",
    "fn h(v: &[i32]) -> i32 {\n    v.iter().copied().max().unwrap_or(0)\n}",
    "def count(words):\n    d = {}\n    for w in words:\n        d[w] = d.get(w, 0) + 1\n    return d",
    "for i in range(1, 16):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)",
    "int sum(int *a, int n) {\n    int s = 0;\n    for (int i = 0; i <= n; i++) s += a[i];\n    return s;\n}",
]
CODE_Q = [
    "What does this code do?\n\n{s}",
    "Explain this code line by line:\n\n{s}",
    "Is there a bug in this code? If so, fix it.\n\n{s}",
    "Rewrite this code to make it easier to read:\n\n{s}",
]

SENTENCES = [
    "The old bakery on the corner opens before sunrise.", "Every morning the baker mixes flour, water and salt.",
    "Children stop by on their way to school.", "The smell of fresh bread fills the whole street.",
    "Last year the owner added a small café with four tables.", "On Sundays there is always a long queue.",
    "The town council plans to repair the bridge next spring.", "Traffic will use the northern road during the work.",
    "Local shops expect fewer customers for a few weeks.", "The project should finish before the summer festival.",
    "Maria started learning the guitar at the age of forty.", "She practises for twenty minutes every evening.",
    "Her teacher says that patience matters more than talent.", "Next month she will play in a small concert.",
    "The museum received a collection of old maps.", "Some of the maps are more than three hundred years old.",
    "Volunteers are cleaning and cataloguing each one.", "An exhibition is planned for the autumn.",
    "Our team finished the quarterly report on Friday.", "Sales grew by eight percent compared with last year.",
    "Costs stayed the same thanks to cheaper transport.", "The manager thanked everyone in a short email.",
]
REWRITE = [
    "Rewrite the following text in a more formal style:\n\n{p}",
    "Translate the following text into simple English for a young reader:\n\n{p}",
    "Summarize the following text in one sentence:\n\n{p}",
    "Rewrite the following text in the future tense:\n\n{p}",
    "Turn the following text into a bulleted list of facts:\n\n{p}",
    "Correct any mistakes and improve the style of this text:\n\n{p}",
    "Write a headline and a two-sentence summary for this text:\n\n{p}",
]

REASON = [
    "If a train travels {a} kilometres in {b} hours, what is its average speed? Explain step by step.",
    "I have {a} apples and give away {b}. How many do I have left? Show your reasoning.",
    "A shop sells pencils at {b} cents each. How much do {a} pencils cost?",
    "What is {a} multiplied by {b}? Explain how you calculate it.",
    "A recipe needs {b} eggs for {a} people. How many eggs are needed for twice as many people?",
]


def main() -> None:
    out = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 1600
    rng = random.Random(20261130)
    prompts = []
    kinds = ["chat"] * 10 + ["code"] * 3 + ["codeq"] * 1 + ["rewrite"] * 3 + ["reason"] * 1
    seen = set()
    while len(prompts) < count:
        k = rng.choice(kinds)
        if k == "chat":
            t, u = rng.sample(TOPICS, 2)
            p = rng.choice(CHAT).format(t=t, u=u)
        elif k == "code":
            p = rng.choice(CODE).format(l=rng.choice(LANGS), c=rng.choice(CODE_TASKS))
        elif k == "codeq":
            p = rng.choice(CODE_Q).format(s=rng.choice(SNIPPETS))
        elif k == "rewrite":
            start = rng.randrange(0, len(SENTENCES) - 3)
            para = " ".join(SENTENCES[start:start + rng.randint(3, 5)])
            p = rng.choice(REWRITE).format(p=para)
        else:
            p = rng.choice(REASON).format(a=rng.randint(2, 60), b=rng.randint(2, 12))
        if p in seen:
            continue
        seen.add(p)
        prompts.append({"prompt": p, "kind": k})
    with open(out, "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    print(f"wrote {out} ({len(prompts)} prompts)")


if __name__ == "__main__":
    main()
