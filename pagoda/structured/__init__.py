"""Structured outputs: constraints (JSON schema, JSON object, regex, choice, EBNF grammar) compiled
by xgrammar into grammars that mask each step's logits. See docs/structured_outputs.md."""
