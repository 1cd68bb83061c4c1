"""Structured outputs on a real model: the same chat requests asking for a JSON object, once with the
prompt alone and once with ``response_format`` (a JSON schema), greedy and sampled; prints how many
answers parse as JSON and follow the schema, and the output tokens per second of each batch.

    python -m loadtest.bench.guided                      # starts pagedserve serve on the default model
    python -m loadtest.bench.guided --url http://127.0.0.1:8000

The schema is checked by hand here (``conforms``), not by the guide. Throughputs of the two modes
are not a like-for-like cost comparison (the guided answers are shorter and end sooner); what a
guided row costs the sampler per step is measured apart (``docs/journal/profile-journal.md``,
twenty-third session).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import time

from loadtest.bench.servers import served_model_name, start_server
from loadtest.bench.throughput_report import say
from loadtest.common.machine_state import print_cpu

SUBJECTS = ["a librarian in Lisbon", "a retired pilot", "a chef from Osaka", "a student in Nairobi",
            "a painter in Oslo", "a doctor in Lima", "a baker in Lyon", "a teacher in Seoul", "a farmer in Iowa",
            "a poet in Dublin", "a nurse in Manila", "a miner in Chile", "an engineer in Pune", "a sailor in Hamburg",
            "a dancer in Havana", "a judge in Cairo", "a guide in Nepal", "a tailor in Naples", "a coder in Austin",
            "a singer in Lagos"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def conforms(value) -> bool:
    return (isinstance(value, dict) and set(value) == set(SCHEMA["properties"])
            and isinstance(value["name"], str) and len(value["name"]) <= 40 and type(value["age"]) is int
            and isinstance(value["city"], str) and len(value["city"]) <= 40 and isinstance(value["hobbies"], list)
            and len(value["hobbies"]) <= 3 and all(isinstance(h, str) and len(h) <= 30 for h in value["hobbies"]))


def messages(subject: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe {subject} as a JSON object with the keys name, age, city and "
                                        f"hobbies (a list of strings). Answer with the JSON only."}]


async def one(client, model: str, subject: str, guided: bool, temperature: float, seed: int, max_tokens: int):
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    return await client.chat.completions.create(model=model, messages=messages(subject), max_tokens=max_tokens,
                                                temperature=temperature, seed=seed, **(extra if guided else {}))


async def batch(client, model: str, guided: bool, temperature: float, rounds: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    responses = await asyncio.gather(*(one(client, model, s, guided, temperature, 7 * i + r, max_tokens)
                                       for r in range(rounds) for i, s in enumerate(SUBJECTS)))
    wall = time.perf_counter() - t0
    parsed = conform = stopped = tokens = 0
    for response in responses:
        choice = response.choices[0]
        tokens += response.usage.completion_tokens
        stopped += choice.finish_reason == "stop"
        try:
            value = json.loads(choice.message.content)
        except ValueError:
            continue
        parsed += 1
        conform += conforms(value)
    return {"requests": len(responses), "finished": stopped, "json": parsed, "schema": conform,
            "out_tokens": tokens, "seconds": round(wall, 2), "tok_s": round(tokens / wall, 1)}


async def run(url: str, rounds: int, max_tokens: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    model = served_model_name(url)
    await batch(client, model, True, 0.0, 1, max_tokens)  # warm-up: kernels, the guide's first masks
    print(f"{'temperature':>11} {'mode':>26} {'requests':>8} {'finished':>8} {'json':>5} {'schema':>6} "
          f"{'out tok':>7} {'tok/s':>7}")
    for temperature in (0.0, 0.8):
        for guided in (False, True):
            r = await batch(client, model, guided, temperature, rounds if temperature else 1, max_tokens)
            mode = "response_format json_schema" if guided else "prompt alone"
            print(f"{temperature:>11} {mode:>26} {r['requests']:>8} {r['finished']:>8} {r['json']:>5} "
                  f"{r['schema']:>6} {r['out_tokens']:>7} {r['tok_s']:>7}", flush=True)
    example = await one(client, model, SUBJECTS[0], True, 0.0, 0, max_tokens)
    print("a guided answer:", example.choices[0].message.content)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a pagedserve (or any OpenAI-compatible server) already running")
    ap.add_argument("--server-flags", default="", help="flags for the pagedserve serve this starts")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the 20 requests when sampling")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    print_cpu()
    proc = None
    url = args.url
    if url is None:
        say("starting pagedserve serve")
        proc, url = start_server(shlex.split(args.server_flags), "/tmp/pagedserve-guided-server.log")
    try:
        asyncio.run(run(url, args.rounds, args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
