#!/usr/bin/env python3
"""Writes docs/workloads/warmup.jsonl: 200 generic prompts of our own (40 topics x 5 tasks) that
warm a token-recycling table before a benchmark (`spec-bench warm-recycling`). Deterministic:
no randomness, the same file on every run. None of the topics appears in the evaluation
workloads (docs/workloads/smollm2.jsonl, docs/workloads/agentic.jsonl)."""
import json
import pathlib

TOPICS = [
    "bread baking", "bicycle repair", "composting", "the water cycle", "volcanoes", "chess openings",
    "saving money", "learning a language", "public libraries", "bees", "solar panels", "time zones",
    "coffee brewing", "first aid for burns", "sleep", "the moon", "recycling plastic", "job interviews",
    "houseplants", "train travel", "rain forests", "electric cars", "writing a CV", "photography",
    "the human heart", "desert animals", "board games", "meditation", "city parks", "bridges",
    "the printing press", "penguins", "running shoes", "email etiquette", "tides", "museums",
    "vegetable soup", "spreadsheets", "wind energy", "kindness",
]
TASKS = [
    "Explain {t} to a twelve-year-old in a few sentences.",
    "Give five short tips about {t}.",
    "Write a short paragraph about the history of {t}.",
    "What are common mistakes people make with {t}, and how can they avoid them?",
    "Answer with a JSON object with the keys \"topic\", \"summary\" and \"facts\" (a list of three strings) about {t}.",
]

def main() -> None:
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "workloads" / "warmup.jsonl"
    with out.open("w") as f:
        for task in TASKS:
            for topic in TOPICS:
                f.write(json.dumps({"prompt": task.format(t=topic), "kind": "warmup", "max_tokens": 64}) + "\n")
    print(f"wrote {out} ({len(TASKS) * len(TOPICS)} prompts)")

if __name__ == "__main__":
    main()
