"""entrypoints: the front doors, where users come in.

    cli.py    the command table: ``python -m minipaged chat | generate | fetch | bench``
    args.py   the engine and sampling flags every command shares (vLLM's names), turned into
              LLMEngine keyword arguments and SamplingParams
    chat.py   the interactive chat loop: streams each answer, trims old turns to fit
    api_server.py       ``serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn), the system-call gate:
                        its routes, liveness, and the uvicorn process around them
    openai_serving.py   what every endpoint shares: checks, queueing prompts, whole or streamed answers
    serving_completion.py, serving_chat.py   /v1/completions and /v1/chat/completions
    api_errors.py       every failure as OpenAI's error JSON (the errno of the gate)
    http_limits.py      limits before work: request body size, header-read and keep-alive timeouts,
                        concurrent connections (the gate's rlimits)
    openai_protocol.py  OpenAI's request shapes (pydantic) and the SamplingParams they become
    tool_calls.py       function calling: tools and a named or "required" tool_choice as a grammar,
                        the constrained answer as tool_calls
    prometheus.py       ``GET /metrics``: the engine's counters under vLLM's Prometheus names

The Python API's front door is ``minipaged.LLM`` (engine/llm.py). Entry points call the
engine and the tools below them; nothing below imports them.
"""
