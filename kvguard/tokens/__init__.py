"""A request body and its prompt token count, exactly as vLLM will count it.

request.py (what a body must be), counting.py (the entry point, off the event loop),
tokenizer.py (a pool's tokenizer and chat template), chat_messages.py, chat_arguments.py and
chat_template.py (rendering as vLLM and transformers do), segments.py, pretokens.py and
prefix_bound.py (exact counts without tokenizing everything again).
"""
