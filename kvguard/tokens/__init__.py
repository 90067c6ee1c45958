"""A request body and its prompt token count, exactly as vLLM will count it.

In the order a count runs: request.py (what a body must be, how its fields are read),
counting.py (the entry point, off the event loop), responses_api.py and messages_api.py (a
Responses or Messages body as the chat vLLM renders for it), tokenizer.py (a pool's tokenizer and
chat templates), then chat_arguments.py, chat_messages.py and chat_template.py (rendering as vLLM
and transformers do), and segments.py, pretokens.py and prefix_bound.py (exact counts without
tokenizing everything again).
"""
