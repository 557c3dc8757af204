"""Speculative decoding: a proposer guesses each sequence's next tokens, the target's step
verifies them (speculator.py). Modules: speculator.py (the Speculator interface, its
no-op default, and SpeculativeDecoding), setup.py (a method's models and memory),
proposers.py (n-gram, Medusa), draft_model.py, eagle.py, drafts.py (chains and trees of
drafts), state.py (a sequence's speculative state), stats.py (the counters), device.py
and rounds.py (their work on the device). Nothing here imports engine.py."""
