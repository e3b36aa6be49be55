"""`python -m server` in a checkout: the entry point of pyturbo's OpenAI-compatible server, whose
code is the installed package pyturbo.server (`python -m pyturbo.server` anywhere)."""
