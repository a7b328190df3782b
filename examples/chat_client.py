"""A multi-turn chat against `candle-gate serve` with the official openai client.

    candle-gate serve &                   # http://127.0.0.1:8000/v1, SmolLM2 by default
    python examples/chat_client.py [--base-url URL] [--model NAME]

Each turn reports how many prompt tokens the server took from its prefix cache
(`usage.prompt_tokens_details.cached_tokens`): the history after the first turn.
"""
import argparse

import openai

ap = argparse.ArgumentParser()
ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
ap.add_argument("--model", default="smollm2-135m-instruct-q4_1")
a = ap.parse_args()

client = openai.OpenAI(base_url=a.base_url, api_key="unused")
history = []
for question in ["Name three colors.", "Which of them is the warmest?", "Write a haiku about it."]:
    history.append({"role": "user", "content": question})
    r = client.chat.completions.create(model=a.model, messages=history, temperature=0, max_tokens=48)
    answer = r.choices[0].message.content
    history.append({"role": "assistant", "content": answer})
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    print(f"> {question}\n{answer}\n  [{cached} of {r.usage.prompt_tokens} prompt tokens cached; {r.system_fingerprint}]\n")
