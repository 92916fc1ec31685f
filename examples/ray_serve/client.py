"""Four agents and a fan-out against the cluster deploy.py started, with OpenAI's client; prints which replica
answered each request (the X-Kvrt-Replica header) and what each found cached.

    python examples/ray_serve/client.py [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def ask(client: OpenAI, model: str, messages: list[dict[str, str]], agent: str | None) -> str:
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=32,
                                                           temperature=0, **({"user": agent} if agent else {}))
    answer = raw.parse()
    usage = answer.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    print(f"  {agent or 'anonymous':>10} -> replica {raw.headers.get('x-kvrt-replica')}: "
          f"{usage.prompt_tokens if usage else '?'} prompt tokens, {cached} cached")
    return answer.choices[0].message.content or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    print("four agents, three turns each: every turn of an agent on its replica, its history cached")
    for agent in ("alice", "bob", "carol", "dave"):
        messages = [{"role": "user", "content": f"My name is {agent}. Name a colour."}]
        for question in ("Another one?", "And a third?", "Thanks."):
            messages.append({"role": "assistant", "content": ask(client, model, messages, agent)})
            messages.append({"role": "user", "content": question})
    print("a fan-out: anonymous questions over one document land on the replica that has it cached")
    document = "Ray Serve routes requests to replicas. " * 60
    for question in ("Summarise it.", "What routes requests?", "How long is it?"):
        ask(client, model, [{"role": "system", "content": document}, {"role": "user", "content": question}], None)


if __name__ == "__main__":
    main()
