"""An agent framework (the OpenAI Agents SDK) running its tool loop against ``kvrt serve --http``, a real process.

The model is the tiny test model with a Jinja template that teaches tools: its text is
noise, so the first turn forces the call (``tool_choice="required"``; the SDK resets the
choice to ``auto`` once a tool has run) and the agent's typed output makes the SDK ask for
JSON of its schema, which kvrt's grammar guarantees, so the second turn ends. What is
checked is the loop's structure: the tool ran with arguments its schema accepts, its result
went back to the model in the next request, and the run ended with a final answer the SDK
validated. Through chat completions and through the Responses API, each unstreamed and
streamed (the SDK assembles streamed tool calls from their deltas or events itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

agents = pytest.importorskip("agents", reason="the test extra's openai-agents is not installed")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from test_serve_http_cli import WAIT_S, serving  # noqa: E402  (pytest puts tests/ on sys.path)


@pytest.fixture(scope="module")
def base_url(tools_model_path: Path) -> Iterator[str]:
    """``kvrt serve --http`` on the tools test model; yields its base URL."""
    with serving("--model", str(tools_model_path), "--n-ctx", "4096", "--slots", "2", "--threads", "1") as url:
        yield url


class Forecast(pydantic.BaseModel):
    """The agent's final answer."""

    sunny: bool


def weather_agent(base_url: str, model_name: str, api: str = "chat") -> tuple[agents.Agent, list[dict[str, object]]]:
    """An agent with one tool that records its calls; its first model turn must call a tool. ``api``: the SDK
    speaks chat completions (``chat``) or the Responses API (``responses``) to kvrt."""
    calls: list[dict[str, object]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], days: int) -> str:
        """The weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=WAIT_S)
    kind = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
    model = kind(model=model_name, openai_client=client)
    model_settings = agents.ModelSettings(tool_choice="required", temperature=0, parallel_tool_calls=False,
                                          max_tokens=200)
    agent = agents.Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather],
                         output_type=Forecast, model=model, model_settings=model_settings)
    return agent, calls


def check_loop(result: agents.RunResultBase, calls: list[dict[str, object]]) -> None:
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert len(calls) == 1 and calls[0]["city"] in ("Paris", "Tokyo", "Lima") and isinstance(calls[0]["days"], int)
    assert result.new_items[1].output == f"sunny in {calls[0]['city']} for {calls[0]['days']} days"
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2  # the call, then the answer that read the tool's result


@pytest.fixture(autouse=True)
def _no_tracing() -> None:
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_calls_a_tool_and_answers(base_url, tools_model_path, api):
    agent, calls = weather_agent(base_url, tools_model_path.stem, api)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris for 3 days?", max_turns=4))
    check_loop(result, calls)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_streamed_agent_run_assembles_the_call_from_deltas(base_url, tools_model_path, api):
    agent, calls = weather_agent(base_url, tools_model_path.stem, api)

    async def run() -> agents.RunResultStreaming:
        streamed = agents.Runner.run_streamed(agent, "What is the weather in Lima?", max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return streamed

    check_loop(asyncio.run(run()), calls)
