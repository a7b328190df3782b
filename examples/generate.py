"""The Python package in a few lines: the same answer whatever shares the batch."""
import candle_gate

model = candle_gate.Model.load()  # SmolLM2-135M-Instruct Q4_1, downloaded once

# Greedy, alone and beside other prompts: the same tokens and the same fingerprint.
[alone] = model.generate(["The capital of France is"], max_new_tokens=12)
batched = model.generate(["The capital of France is", "def fibonacci(n):", "Once upon a time"], max_new_tokens=12)
assert alone.token_ids.tolist() == batched[0].token_ids.tolist()
print(repr(alone.text), alone.fingerprint)

# Seeded sampling with three choices and logprobs: replayable from the seed.
params = candle_gate.SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=7, n=3, logprobs=True)
[r] = model.generate([[{"role": "user", "content": "Name a color."}]], params=params)
for c in r.choices:
    print(c.index, repr(c.text), float(c.logprobs.sum()))

# An engine keeps its prefix cache across requests: the second turn reuses the first's K/V.
eng = candle_gate.Engine(model)
chat = [{"role": "user", "content": "Write two sentences about the sea."}]
first = eng.run([eng.submit(chat, chat=True, max_new_tokens=32)])[0]
chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now one about rivers."}]
second = eng.run([eng.submit(chat, chat=True, max_new_tokens=32)])[0]
print(f"second turn: {second.cached_tokens} of {second.prompt_tokens} prompt tokens from the cache")
print(eng.kv_stats())
