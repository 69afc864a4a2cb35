"""kvcache: fast, frugal CPU KV-cache offloading for vLLM.

Minimal placeholder from the ``replay`` branch (reconciled at merge): it must stay free of
vLLM/torch imports so that ``python -m kvcache`` starts fast.
"""
