"""The engine core: the loop that schedules, executes and updates, and nothing else.

- :mod:`core.engine_core.types`: the values that cross between the engine core and its
  front ends (requests in, per-request token deltas out), msgspec-encodable;
- :mod:`core.engine_core.core`: :class:`~core.engine_core.core.EngineCore`, the loop itself
  (no tokenizer, no text);
- :mod:`core.engine_core.process`: the engine core in its own process, spoken to over ZeroMQ.

The offline ``LLM`` runs :class:`EngineCore` in-process (:class:`core.engine.LLMEngine`);
the OpenAI server talks to one in a child process (:class:`core.async_engine.AsyncLLMEngine`).
This package's ``__init__`` imports nothing, so the scheduler can use the types without a cycle.
"""
