"""Ways into the engine from outside the serving path: the offline API
(:class:`~pdserve.engine.entrypoints.llm.LLM`: prompts in, results out, for scripts, tests
and benchmarks) and the command-line flags every ``pdserve`` subcommand shares, with their
conversion to an :class:`~pdserve.engine.config.EngineConfig` (:mod:`.arg_utils`). The
workers drive :class:`~pdserve.engine.llm_engine.LLMEngine` directly; nothing on the serving
path imports this package."""
