"""LangChain's ``ChatOpenAI`` with ``bind_tools`` (a client no one here wrote) in an agent loop against
the frontend with tool_choice "auto" (hermes' parser) and the fake engine told what real models write:
the model calls a tool, the loop runs it and sends its result back as a ``ToolMessage``, and the model
answers from it. The fake engine answers a prompt's last ``[[say]]`` text, which the tool's result
carries: the final answer can only be that text if the tool's result reached the prompt through the
chat template. Whole and streamed (``tool_call_chunks`` accumulated by LangChain itself)."""

from __future__ import annotations

import dataclasses

import pytest

import langchain_openai
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool

from tests.doubles.fake_scheduler import FrontendThread

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
QUESTION = f"What time is it in UTC? [[say]]Let me check.\n{CALL}[[/say]]"


@tool
def get_time(zone: str) -> str:
    """The time in a zone."""
    return f"[[say]]It is 12:00 in {zone}, says the clock.[[/say]]"


@pytest.fixture(scope="module")
def chat(model, fake):
    server = FrontendThread(dataclasses.replace(model, tool_parser="hermes"), fake.endpoints).start()
    yield langchain_openai.ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model=model.name,
                                      max_retries=0, timeout=20, max_tokens=80)
    server.stop()


def run_agent(llm, question: str, *, stream: bool, max_turns: int = 4):
    """The loop LangChain's tool-calling docs show: call the model, run each tool it asks for, send the
    results back, until it answers without a call. Returns (every model message, the tool messages)."""
    messages, replies, results = [HumanMessage(question)], [], []
    tools = {"get_time": get_time}
    for _ in range(max_turns):
        if stream:
            reply = None
            for chunk in llm.stream(messages):
                reply = chunk if reply is None else reply + chunk
        else:
            reply = llm.invoke(messages)
        replies.append(reply)
        messages.append(reply)
        if not reply.tool_calls:
            return replies, results
        for call in reply.tool_calls:
            result = tools[call["name"]].invoke(call)  # a ToolMessage carrying the call's id
            results.append(result)
            messages.append(result)
    raise AssertionError(f"no answer in {max_turns} turns: {replies}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_langchain_agent_calls_a_tool_and_answers_with_its_result(chat, fake, stream):
    replies, results = run_agent(chat.bind_tools([get_time]), QUESTION, stream=stream)
    assert len(replies) == 2 and len(results) == 1
    first, answer = replies
    assert first.content == "Let me check."
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_time", {"zone": "UTC"})]
    assert isinstance(results[0], ToolMessage) and results[0].tool_call_id == first.tool_calls[0]["id"]
    assert answer.content == "It is 12:00 in UTC, says the clock." and answer.tool_calls == []
    # what LangChain sent on the second turn: the call, and the tool's result answering it by id
    sent = fake.added[-1]
    assert sent.sampling.guided is None  # "auto": free output
    assert "It is 12:00 in UTC, says the clock." in chat_prompt(fake, sent)


def chat_prompt(fake, request) -> str:
    return fake.tokenizer.decode(list(request.prompt_token_ids))
