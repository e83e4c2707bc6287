"""Output parsers for GLM-5.3-Flash, registered over vLLM's ``glm47`` and ``glm45``.

``tool.Glm47ToolParser`` (tool calls) and ``reasoning.Glm47ReasoningParser`` (reasoning) subclass vLLM's
``ToolParser`` / ``ReasoningParser``; both run the incremental machines in ``machine`` over the output as
split into text and tags by ``lexer``. Argument typing from the request's schema is in ``schema``.
"""
