"""Connectors in the shapes SGLang's and vLLM's disaggregation layers call (sglang.py,
vllm.py), built on kvagent.Client. Neither framework is imported: the classes follow
their public interfaces, so a thin subclass inside each framework can wire them."""
