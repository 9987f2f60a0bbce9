"""The OpenAI Agents SDK tests need ``openai-agents``, which cannot share an environment
with ``hermes-agent`` (openai 3 vs its openai 2 pin): ``scripts/test.sh`` runs them in
``.venv-agents``; an environment without the SDK does not collect them."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("agents") else ["test_openai_agents*.py"]
