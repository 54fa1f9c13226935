"""The engine's command-line face: the flags every ``pdserve`` subcommand shares and their
conversion to a validated :class:`~pdserve.engine.config.EngineConfig`. Only entry points
(the CLI, the launcher) import it; nothing on the serving path does."""
