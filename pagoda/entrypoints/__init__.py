"""The ways in: the `pagoda` commands, the OpenAI server and the offline `LLM` API."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # of the commands' and LLM's log lines
