"""An agent written against the `openai` client, as it would run against any OpenAI-compatible server: it asks the
question, then asks the model to look again, and answers with the second reply. RLFleet hands it a client bound to
one generator's endpoint and a session of its own, and trains on the tokens the endpoint recorded for the episode.

    roles:
      environment: {type: agent, path: manifests/examples/agent/second_look.py, function: run}
"""


def run(client, example):
    messages = [{"role": "user", "content": example.prompt}]
    for follow_up in ("Look again: what is the answer?", None):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return 0.0  # the job's scorers grade the final answer
