"""The router: the public entry. Validates, reserves decode room, starts prefill, relays tokens.

It tokenizes and routes but never loads the model and never imports torch.
"""
